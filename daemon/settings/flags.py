"""The argparse flags of a command, and their defaults from the environment, made from the
settings table: a flag is declared in cpud.settings and nowhere else."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from cpud.settings import ENGINE, ENV_COMMANDS, SERVE, Setting, in_group

N = TypeVar("N", int, float)


class StoreGiven(argparse.Action):
    """Stores the value and notes that the flag came on the command line (in `given`), which
    an environment default does not."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = {*namespace.given, self.dest}


def positive(kind: Callable[[str], N]) -> Callable[[str], N]:
    """`kind` that refuses values of 0 or less, with argparse's error."""

    def parse(text: str) -> N:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return parse


def add_flags(
    parser: argparse.ArgumentParser, command: str, *, check_positive: bool = False
) -> None:
    """The flags of every setting `command` uses, in table order. check_positive: settings
    that must be positive refuse other values while parsing (else the engine refuses them
    when it resolves its config)."""
    documents_env = command in ENV_COMMANDS
    notes_given = False
    for item in in_group(command):
        parser.add_argument(*item.flags, **_argument(item, check_positive, documents_env))
        notes_given = notes_given or item.note_given
    if notes_given:
        parser.set_defaults(given=frozenset())


def _argument(item: Setting, check_positive: bool, documents_env: bool) -> dict[str, Any]:
    options: dict[str, Any] = {"dest": item.dest, "default": item.default}
    if item.type is bool:
        options["action"] = argparse.BooleanOptionalAction if item.negatable else "store_true"
    else:
        kind = positive(item.type) if check_positive and item.positive else item.type
        options["type"] = kind
        if item.note_given:
            options["action"] = StoreGiven
    if item.many:
        options["nargs"] = "+"
    if item.choices is not None:
        options["choices"] = item.choices
    if item.metavar is not None:
        options["metavar"] = item.metavar
    notes = []
    if documents_env:
        notes.append("env " + " or ".join(item.env_names))
    if item.default is not None and item.default is not False:
        notes.append("default %(default)s")
    text = item.help.replace("%", "%%")
    options["help"] = f"{text} [{'; '.join(notes)}]" if notes else text
    return options


def apply_env_defaults(
    parser: argparse.ArgumentParser, command: str, environ: Mapping[str, str]
) -> None:
    """The defaults of `command`'s flags from the environment (a variable set to blanks is
    unset); ConfigError naming the variable for a value the flag would refuse."""
    from cpud.settings import envs

    for item in in_group(command):
        action = parser._option_string_actions[item.long_flag]
        for name in item.env_names:
            raw = environ.get(name, "")
            if not raw.strip():
                continue
            kind = "bool" if item.type is bool else "list" if item.many else "value"
            value = envs.parse_env_value(
                name, raw, item.long_flag, kind, action.type, action.choices
            )
            parser.set_defaults(**{action.dest: value})
            break


def env_variables(command: str = SERVE) -> dict[str, str]:
    """Every environment variable that sets a flag of `command`, mapped to the flag."""
    return {name: item.long_flag for item in in_group(command) for name in item.env_names}


def engine_kwargs(flags: Mapping[str, Any]) -> dict[str, Any]:
    """The engine settings among parsed flags (`vars(namespace)`), by their EngineArgs names,
    the model excepted: a command passes on every engine setting it parses without listing
    them."""
    return {
        item.name: flags[item.dest]
        for item in in_group(ENGINE)
        if item.flags and item.name != "model" and item.dest in flags
    }
