"""Environment variables cpud reads, each parsed in one typed place."""

from __future__ import annotations

import os

from cpud.errors import ConfigError


def _float(name: str) -> float | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None


def kv_cache_space_gib() -> float | None:
    """VLLM_CPU_KVCACHE_SPACE: KV cache size per rank in GiB (vLLM's name, same meaning)."""
    return _float("VLLM_CPU_KVCACHE_SPACE")


def api_key() -> str | None:
    """CPUD_API_KEY, else VLLM_API_KEY (vLLM's name): the key clients must send."""
    return os.environ.get("CPUD_API_KEY") or os.environ.get("VLLM_API_KEY") or None
