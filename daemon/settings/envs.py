"""Environment variables cpud reads, each parsed in one typed place. Which variables set which
setting is declared with the setting, in cpud.settings."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from cpud.settings import setting
from cpud.settings.errors import ConfigError

# vLLM's name for --kv-cache-space: the engine reads it too, so the offline LLM honours it.
KV_CACHE_SPACE_VARIABLE = setting("kv_cache_space_gib").env_aliases[0]
API_KEY_VARIABLES = (*setting("api_key").env_names, *setting("api_key_file").env_names)


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
    return _float(KV_CACHE_SPACE_VARIABLE)


def api_key() -> str | None:
    """CPUD_API_KEY, else VLLM_API_KEY (vLLM's name): the key clients must send."""
    names = setting("api_key").env_names
    return next((os.environ[name] for name in names if os.environ.get(name)), None)


def without_secrets(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` less the API key variables: the environment of the frontend and the ranks
    (the frontend gets the key on its stdin)."""
    return {name: value for name, value in environ.items() if name not in API_KEY_VARIABLES}


# How a boolean flag's variable is spelled.
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


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
