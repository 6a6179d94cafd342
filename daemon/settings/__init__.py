"""Every engine and serve setting, declared once, in one table: its name, type, default,
flags and aliases, environment variables, help, choices, and the groups that use it (the
engine: EngineArgs and the offline LLM's keywords; the commands serve, doctor and generate).

Derived from it: the flags of those commands and their environment defaults
(cpud.settings.flags), the defaults of EngineArgs and ServeArgs, the offline LLM's keywords,
and README's configuration reference (cpud.settings.reference; `python3 -m cpud.settings
--markdown`). Kept free of heavy imports: the CLI reads it on every start.
"""

from __future__ import annotations

from typing import Any

from cpud.settings.engine import (
    DEFAULT_KV_CACHE_SPACE_GIB,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    ENGINE_SETTINGS,
    MAX_MODEL_LEN_CAP,
)
from cpud.settings.serve import CORS_ALLOW_ANY, SERVE_SETTINGS
from cpud.settings.setting import (
    COMMANDS,
    DOCTOR,
    ENGINE,
    ENV_COMMANDS,
    ENV_PREFIX,
    GENERATE,
    GROUPS,
    SERVE,
    Setting,
)

__all__ = [
    "COMMANDS",
    "CORS_ALLOW_ANY",
    "DEFAULT_KV_CACHE_SPACE_GIB",
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "DOCTOR",
    "ENGINE",
    "ENV_COMMANDS",
    "ENV_PREFIX",
    "GENERATE",
    "GROUPS",
    "MAX_MODEL_LEN_CAP",
    "SERVE",
    "SETTINGS",
    "Setting",
    "choices",
    "defaults",
    "in_group",
    "setting",
]

SETTINGS: tuple[Setting, ...] = ENGINE_SETTINGS + SERVE_SETTINGS
_BY_NAME = {s.name: s for s in SETTINGS}
if len(_BY_NAME) != len(SETTINGS):
    raise ValueError("a setting is declared twice in cpud.settings")


def setting(name: str) -> Setting:
    """The setting called `name` (KeyError for none)."""
    return _BY_NAME[name]


def in_group(group: str) -> tuple[Setting, ...]:
    """The settings a group uses, in table order."""
    if group not in GROUPS:
        raise ValueError(f"no settings group {group!r}: groups are {', '.join(GROUPS)}")
    return tuple(s for s in SETTINGS if group in s.groups)


def defaults(group: str) -> dict[str, Any]:
    """Each setting of `group` by name, at its default."""
    return {s.name: s.default for s in in_group(group)}


def choices(name: str) -> tuple[str, ...]:
    """The values setting `name` takes (ValueError for a setting that takes any)."""
    values = setting(name).choices
    if values is None:
        raise ValueError(f"setting {name} has no list of choices")
    return values
