"""How much a template value weighs, and bounds on what an operation would build from its
arguments (before it runs): the measures cpud.text.template_budget charges a render with."""

from __future__ import annotations

import re
from typing import Any

from jinja2.utils import Namespace

TEXT_FACTOR = 12  # str(), repr, tojson or escaping of a value: at most this many chars per unit
URLIZE_FACTOR = 40
TEXT_FILTERS = ("string", "e", "escape", "forceescape", "xmlattr", "urlencode")
BUFFERS = (str, bytes, bytearray)
SEQUENCES = (list, tuple, set, frozenset)
_DIGITS = re.compile(r"\d+")


def size(value: Any, cap: int) -> int:
    """Deep weight of a value, counting shared parts each time they occur; stops past cap."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        total += 1
        if isinstance(item, BUFFERS):
            total += len(item)
        elif isinstance(item, bool) or item is None:
            pass
        elif isinstance(item, int):
            total += item.bit_length() // 3
        elif isinstance(item, SEQUENCES):
            total += len(item)
            if total <= cap:
                stack.extend(item)
        elif isinstance(item, dict):
            total += len(item)
            if total <= cap:
                stack.extend(item.keys())
                stack.extend(item.values())
        elif isinstance(item, Namespace):
            stack.append(object.__getattribute__(item, "_Namespace__attrs"))
        if total > cap:
            return total
    return total


def depth(value: Any, cap: int) -> int:
    """How deeply containers nest in a value (looking at no more than cap items)."""
    deepest, seen = 0, 0
    stack = [(value, 1)]
    while stack and seen <= cap:
        item, level = stack.pop()
        seen += 1
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, SEQUENCES):
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in item)
    return deepest


def text_size(value: Any, cap: int) -> int:
    """An upper bound on the characters of str(value) (repr of containers, escapes)."""
    if isinstance(value, str):
        return len(value)
    return TEXT_FACTOR * size(value, cap // TEXT_FACTOR + 1)


def spec_digits(spec: str) -> int:
    """Widths and precisions a format spec may ask for: every run of digits, summed."""
    total = 0
    for run in _DIGITS.findall(spec):
        total += int(run) if len(run) < 10 else 1 << 40
    return total


def percent_size(fmt: Any, args: Any, cap: int) -> int:
    """str % args: the format, the arguments as text, and any width or precision."""
    text = str(fmt)
    extra = spec_digits(text)
    if "*" in text:
        values = args if isinstance(args, tuple) else (args,)
        extra += sum(v for v in values if isinstance(v, int) and v > 0)
    return len(text) + text_size(args, cap) + extra


def positive(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) and value > 0 else default


def len_text(value: Any) -> int:
    return len(value) if isinstance(value, BUFFERS) else len(str(value))


def replace_size(text: str, old: Any, new: Any, count: Any) -> int:
    hits = len(text) // max(len_text(old), 1) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * len_text(new)


class FilterEstimates:
    """Filters that can build more than they are given: a bound on what they build, from their
    bound arguments (a materialized iterable is put back in place of a lazy one)."""

    @staticmethod
    def center(a: dict, cap: int) -> int:
        return text_size(a["value"], cap) + positive(a["width"])

    @staticmethod
    def indent(a: dict, cap: int) -> int:
        text = str(a["s"])
        width = a["width"]
        pad = len(width) if isinstance(width, str) else positive(width)
        return len(text) + (text.count("\n") + 1) * pad

    @staticmethod
    def format(a: dict, cap: int) -> int:
        return percent_size(a["value"], a["args"] or a["kwargs"], cap)

    @staticmethod
    def join(a: dict, cap: int) -> int:
        items = a["value"] = list(a["value"])
        glue = len(str(a["d"])) * len(items)
        return glue + sum(text_size(item, cap) for item in items)

    @staticmethod
    def replace(a: dict, cap: int) -> int:
        return replace_size(str(a["s"]), a["old"], a["new"], a["count"])

    @staticmethod
    def slice(a: dict, cap: int) -> int:
        return positive(a["slices"]) + size(a["value"], cap)

    @staticmethod
    def batch(a: dict, cap: int) -> int:
        return positive(a["linecount"]) + size(a["value"], cap)

    @staticmethod
    def wordwrap(a: dict, cap: int) -> int:
        text = str(a["s"])
        lines = len(text) // max(positive(a["width"], 1), 1) + text.count("\n") + 1
        return 2 * len(text) + lines * len(a["wrapstring"] or "\n")

    @staticmethod
    def striptags(a: dict, cap: int) -> int:
        text = str(a["value"])
        return len(text) * (text.count("<") + 1)  # each tag removed copies the rest

    @staticmethod
    def tojson(a: dict, cap: int) -> int:
        weight = size(a["x"], cap)
        indent = a["indent"]
        pad = len(indent) if isinstance(indent, str) else positive(indent)
        return TEXT_FACTOR * weight + (weight * depth(a["x"], cap) * pad if pad else 0)

    @staticmethod
    def pprint(a: dict, cap: int) -> int:
        weight = size(a["value"], cap)
        return TEXT_FACTOR * weight + weight * depth(a["value"], cap)

    @staticmethod
    def sum(a: dict, cap: int) -> int:
        items = a["iterable"] = list(a["iterable"])
        kinds = (*BUFFERS, *SEQUENCES)
        if not any(isinstance(x, kinds) for x in (a["start"], *items)):
            return 0  # numbers
        running, total = size(a["start"], cap), 0
        for item in items:  # each addition copies everything so far
            running += size(item, cap)
            total += running
            if total > cap:
                break
        return total
