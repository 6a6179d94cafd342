"""The helpers the deployment tests rely on: the tool guard, unit parsing, syscall filters."""

from __future__ import annotations

import pytest
from deploy_helpers import (
    REQUIRE_ENV,
    allowed_syscalls,
    parse_unit,
    promql_label_names,
    require_tool,
    timespan_seconds,
)


def test_missing_tool_skips_unless_required(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception):
        require_tool("promtool")
    monkeypatch.setenv(REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="promtool is not installed"):
        require_tool("promtool")


def test_parse_unit_keeps_repeated_keys():
    unit = parse_unit("[Service]\n# c\nA=1\nA=~2 3\nB=\n[Install]\nWantedBy=x\n")
    assert unit["Service"] == {"A": ["1", "~2 3"], "B": [""]}
    assert unit["Install"]["WantedBy"] == ["x"]


def test_timespans():
    assert timespan_seconds("60s") == 60
    assert timespan_seconds("1min 30s") == 90
    assert timespan_seconds("15min") == 900
    assert timespan_seconds("45") == 45
    for bad in ("1 fortnight", "soon", ""):
        with pytest.raises(ValueError):
            timespan_seconds(bad)


def test_syscall_filter_merging():
    groups = {"@a": {"read", "write", "@b"}, "@b": {"mbind"}}
    assert allowed_syscalls(["@a"], groups) == {"read", "write", "mbind"}
    assert allowed_syscalls(["@a", "~@b"], groups) == {"read", "write"}
    assert allowed_syscalls(["@a", "~@b", "mbind"], groups) == {"read", "write", "mbind"}


def test_promql_label_names():
    expr = 'sum by (job, le) (rate(x{rank=~"1", numa_node!="0"}[5m])) and on (instance) y'
    assert promql_label_names(expr) == {"job", "le", "rank", "numa_node", "instance"}
