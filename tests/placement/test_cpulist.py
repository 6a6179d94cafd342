"""Linux cpulist parsing (strict) and formatting."""

from __future__ import annotations

import pytest

from cpud.placement.cpulist import format_cpulist, parse_cpulist, parse_id_sequence
from cpud.settings.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("0-3,8,10-11", (0, 1, 2, 3, 8, 10, 11)),
        ("5", (5,)),
        (" 7\n", (7,)),
        ("", ()),
        ("\n", ()),
        ("3,1", (1, 3)),
        ("0, 2", (0, 2)),
        ("4-4", (4,)),
    ],
)
def test_parse(text, cpus):
    assert parse_cpulist(text) == cpus


@pytest.mark.parametrize(
    ("cpus", "text"),
    [
        ((0, 1, 2, 3, 8, 10, 11), "0-3,8,10-11"),
        ((), ""),
        ((3, 1, 2), "1-3"),
        ((0, 2, 4), "0,2,4"),
        ((6, 7), "6-7"),
    ],
)
def test_format(cpus, text):
    assert format_cpulist(cpus) == text
    assert parse_cpulist(text) == tuple(sorted(cpus))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0-", "range '0-' has no end"),
        ("3-1", "runs backwards; write 1-3"),
        ("a", "'a' is not a number"),
        ("1,,2", "empty item between commas"),
        ("1,", "empty item between commas"),
        ("-1", "is negative"),
        ("0--1", "-1 is negative"),
        ("1-2-3", "'2-3' is not a number"),
        ("0-31:2", "is not a number"),
        ("0-3,2", "2 appears more than once"),
    ],
)
def test_parse_errors(text, message):
    with pytest.raises(ConfigError) as err:
        parse_cpulist(text, "--bind")
    assert message in str(err.value)
    assert str(err.value).startswith(f"--bind {text!r}")
    assert "\n" not in str(err.value)


def test_sequence_keeps_order():
    assert parse_id_sequence("1,0") == (1, 0)
    assert parse_id_sequence("4-5,0") == (4, 5, 0)
