"""Linux CPU lists ("0-3,8,10-11"): strict parsing and canonical formatting."""

from __future__ import annotations

from collections.abc import Iterable

from cpud.settings.errors import ConfigError


def _number(token: str, text: str, what: str) -> int:
    if not token.isdigit():
        if token.startswith("-") and token[1:].isdigit():
            raise ConfigError(f"{what} {text!r}: {token} is negative; CPU numbers start at 0")
        raise ConfigError(f"{what} {text!r}: {token!r} is not a number (expected e.g. '0-3,8')")
    return int(token)


def parse_id_sequence(text: str, what: str = "CPU list") -> tuple[int, ...]:
    """Ids in the order written; ranges allowed ("1,0", "4-7,0"); duplicates rejected."""
    text = text.strip()
    if not text:
        return ()
    ids: list[int] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            raise ConfigError(f"{what} {text!r}: empty item between commas")
        first, dash, last = item.partition("-")
        if not dash:
            ids.append(_number(item, text, what))
            continue
        if not first:
            raise ConfigError(f"{what} {text!r}: {item!r} is negative; CPU numbers start at 0")
        if not last:
            raise ConfigError(f"{what} {text!r}: range {item!r} has no end")
        lo, hi = _number(first, text, what), _number(last, text, what)
        if lo > hi:
            raise ConfigError(f"{what} {text!r}: range {item!r} runs backwards; write {hi}-{lo}")
        ids.extend(range(lo, hi + 1))
    seen: set[int] = set()
    for i in ids:
        if i in seen:
            raise ConfigError(f"{what} {text!r}: {i} appears more than once")
        seen.add(i)
    return tuple(ids)


def parse_cpulist(text: str, what: str = "CPU list") -> tuple[int, ...]:
    """Sorted CPU ids of a Linux cpulist; "" is the empty list (a node without CPUs)."""
    return tuple(sorted(parse_id_sequence(text, what)))


def format_cpulist(cpus: Iterable[int]) -> str:
    """The kernel's spelling: sorted, consecutive runs as ranges ("0-3,8,10-11")."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)
