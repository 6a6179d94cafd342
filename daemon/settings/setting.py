"""One engine or serve setting: its name, type, default, flags, environment variables, help,
choices, and the groups that use it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Groups a setting belongs to.
ENGINE = "engine"  # an EngineArgs field and a keyword of the offline LLM(...)
SERVE = "serve"  # a flag of `cpud serve`
DOCTOR = "doctor"  # a flag of `cpud doctor`
GENERATE = "generate"  # a flag of `cpud generate`
GROUPS = (ENGINE, SERVE, DOCTOR, GENERATE)
COMMANDS = (SERVE, DOCTOR, GENERATE)
# Commands whose flag defaults come from the environment (flag > environment > default).
ENV_COMMANDS = (SERVE, DOCTOR)

# Each --foo-bar is also read as CPUD_FOO_BAR; a setting may add vLLM's names (env_aliases).
ENV_PREFIX = "CPUD_"


@dataclass(frozen=True)
class Setting:
    """name: the EngineArgs / ServeArgs field or LLM keyword (for a serve-only setting without a
    field, the flag's destination). type: str, int, float or bool; a bool whose default is not
    False also takes --no-FLAG. many: the flag takes one or more words (a tuple or list).
    positive: only values above 0 are valid (`cpud doctor` refuses others while parsing).
    note_given: the command line's use is noted in the namespace's `given` set, so that a flag
    can beat another setting's environment variable. shown_default: the default as the
    reference says it, where the value (None, say) does not tell. details: the reference's
    longer meaning, where `help` is too short for it."""

    name: str
    type: Callable[[str], Any]
    default: Any
    help: str
    groups: frozenset[str]
    flags: tuple[str, ...] = ()
    env_aliases: tuple[str, ...] = ()
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    many: bool = False
    positive: bool = False
    note_given: bool = False
    shown_default: str | None = None
    details: str | None = None

    def __post_init__(self) -> None:
        problems = []
        if not self.groups or not self.groups <= set(GROUPS):
            problems.append(f"groups {sorted(self.groups)} are not among {GROUPS}")
        if self.groups & set(COMMANDS) and not self.flags:
            problems.append("a command uses it but it has no flag")
        if self.flags and not any(f.startswith("--") for f in self.flags):
            problems.append("it has no long --flag")
        if self.flags and not self.groups & set(COMMANDS):
            problems.append("it has flags but no command uses it")
        if self.env_aliases and not self.flags:
            problems.append("environment variables set flags: it has none")
        if self.choices is not None and self.default not in (None, *self.choices):
            problems.append(f"default {self.default!r} is not one of {self.choices}")
        if self.type not in (str, int, float, bool):
            problems.append(f"type {self.type!r} is not str, int, float or bool")
        if problems:
            raise ValueError(f"setting {self.name}: {'; '.join(problems)}")

    @property
    def long_flag(self) -> str:
        """The flag the setting goes by (its first long one)."""
        return next(f for f in self.flags if f.startswith("--"))

    @property
    def dest(self) -> str:
        """The argparse destination of its flags (what argparse derives from the long flag)."""
        return self.long_flag.removeprefix("--").replace("-", "_")

    @property
    def env_names(self) -> tuple[str, ...]:
        """Environment variables that set its flag, strongest first."""
        if not self.flags:
            return ()
        return (ENV_PREFIX + self.dest.upper(), *self.env_aliases)

    @property
    def keyword_aliases(self) -> tuple[str, ...]:
        """Other keywords of the offline LLM(...) for it: its other long flags
        (--tensor-parallel-size: tensor_parallel_size)."""
        if ENGINE not in self.groups or not self.flags:
            return ()
        others = (f for f in self.flags if f.startswith("--") and f != self.long_flag)
        return tuple(f.removeprefix("--").replace("-", "_") for f in others)

    @property
    def negatable(self) -> bool:
        """A boolean on (or unset) by default also takes --no-FLAG; one off is a switch."""
        return self.type is bool and self.default is not False
