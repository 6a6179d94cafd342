"""Environment variables cpud reads, each parsed in one typed place."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

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


API_KEY_VARIABLES = ("CPUD_API_KEY", "VLLM_API_KEY", "CPUD_API_KEY_FILE")


def without_secrets(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` less the API key variables: the environment of the frontend and the ranks
    (the frontend gets the key on its stdin)."""
    return {name: value for name, value in environ.items() if name not in API_KEY_VARIABLES}


# `cpud serve` flags also read from the environment (flag > env > default): each --foo-bar as
# CPUD_FOO_BAR, and the vLLM names below, so a vLLM CPU deployment's environment carries over.
ENV_PREFIX = "CPUD_"
VLLM_FLAG_ENV = {
    "--bind": "VLLM_CPU_OMP_THREADS_BIND",
    "--reserved-cpus": "VLLM_CPU_NUM_OF_RESERVED_CPU",
    "--kv-cache-space": "VLLM_CPU_KVCACHE_SPACE",
    "--api-key": "VLLM_API_KEY",
}
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def flag_env_names(flag: str) -> list[str]:
    """Environment variables that set `flag`, strongest first."""
    names = [ENV_PREFIX + flag.removeprefix("--").replace("-", "_").upper()]
    if flag in VLLM_FLAG_ENV:
        names.append(VLLM_FLAG_ENV[flag])
    return names


def parse_env_value(name: str, raw: str, flag: str, kind: str, convert, choices) -> object:
    """`raw` as the flag would take it; ConfigError naming the variable otherwise.
    kind: "bool", "list" or "value"."""
    text = raw.strip()
    if kind == "bool":
        if text.lower() in TRUE_WORDS:
            return True
        if text.lower() in FALSE_WORDS:
            return False
        raise ConfigError(f"{name}={raw!r} (sets {flag}) must be one of true/false, 1/0, yes/no")
    if kind == "list":
        return [item for item in text.replace(",", " ").split() if item]
    try:
        value = convert(text) if convert is not None else text
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        why = str(exc) if isinstance(exc, argparse.ArgumentTypeError) else "not a valid value"
        raise ConfigError(f"{name}={raw!r} (sets {flag}): {why}") from None
    if choices is not None and value not in choices:
        raise ConfigError(f"{name}={raw!r} (sets {flag}) must be one of {', '.join(choices)}")
    return value
