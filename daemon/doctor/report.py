"""One verdict per item, and the two ways to print them: text for people, JSON for tools."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

Status = Literal["ok", "warn", "fail"]

EXIT_OK = 0  # no item failed (warnings allowed)
EXIT_FAIL = 1  # at least one item failed

GiB = 1 << 30

_MARKS = {"ok": "[ok]  ", "warn": "[warn]", "fail": "[FAIL]"}
_INDENT = " " * 7


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    # one line for the text report
    summary: str
    # the facts behind the verdict, JSON-serializable
    value: Any
    # what to change, one sentence per entry, naming the flag or env var
    advice: tuple[str, ...] = ()
    # indented lines under the summary in the text report (per-rank placement, notes)
    details: tuple[str, ...] = ()

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "summary": self.summary,
            "value": self.value,
            "advice": "; ".join(self.advice),
        }


def gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB"


def exit_code(checks: Sequence[Check]) -> int:
    return EXIT_FAIL if any(c.status == "fail" for c in checks) else EXIT_OK


def report(checks: Sequence[Check]) -> dict[str, Any]:
    """{"ok": no item failed, "checks": [{name, status, summary, value, advice}]}."""
    return {
        "ok": exit_code(checks) == EXIT_OK,
        "checks": [c.as_json() for c in checks],
    }


def render(checks: Sequence[Check]) -> str:
    lines = []
    for check in checks:
        lines.append(f"{_MARKS[check.status]} {check.name}: {check.summary}")
        lines += [f"{_INDENT}  {line}" for line in check.details]
        lines += [f"{_INDENT}-> {advice}" for advice in check.advice]
    failed = sum(c.status == "fail" for c in checks)
    warned = sum(c.status == "warn" for c in checks)
    lines.append(
        f"{len(checks)} checks: {failed} failed, {warned} with warnings (exit {exit_code(checks)})"
    )
    return "\n".join(lines)
