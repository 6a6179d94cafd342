"""perf/read_periods.py: decode figures compared only within one memory-read period."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "perf"))

from read_periods import bracketed, mixed, paired_by_period  # noqa: E402


class FakeProbe:
    def __init__(self, readings: list[float]) -> None:
        self.readings = iter(readings)

    def gbs(self) -> float:
        return next(self.readings)


def test_bracketed_reads_the_probe_before_and_after_the_run():
    order = []
    probe = FakeProbe([34.0, 61.0])
    value, readings = bracketed(probe, lambda: order.append("run") or 12.5)
    assert (value, readings, order) == (12.5, [34.0, 61.0], ["run"])


def test_mixed_is_a_spread_past_a_quarter():
    assert not mixed([34.0, 40.0, 42.0])
    assert mixed([34.0, 61.0])


def test_engines_compare_only_within_their_own_period():
    samples = {
        "cpud": [(100.0, [61.0, 60.0]), (74.0, [34.0, 35.0]), (90.0, [35.0, 60.0])],
        "llama.cpp": [(81.5, [62.0, 61.0]), (75.0, [34.0, 34.0]), (70.0, [33.0, 36.0])],
    }
    out = paired_by_period(samples)
    fast, slow = out["periods"]["fast"], out["periods"]["slow"]
    assert out["left_out_mixed"] == 1  # cpud's third sample spans both periods
    assert fast["ratio_cpud_to_llama.cpp"] == pytest.approx(100.0 / 81.5)
    assert slow["llama.cpp"]["samples"] == 2
    assert slow["ratio_cpud_to_llama.cpp"] == pytest.approx(74.0 / 72.5)


def test_one_period_when_the_probe_holds_still():
    samples = {"cpud": [(50.0, [34.0, 35.0])], "llama.cpp": [(40.0, [36.0, 35.0])]}
    out = paired_by_period(samples)
    assert list(out["periods"]) == ["one"]
    assert out["periods"]["one"]["ratio_cpud_to_llama.cpp"] == pytest.approx(1.25)


def test_a_period_one_engine_missed_has_no_ratio():
    samples = {
        "cpud": [(100.0, [61.0, 61.0]), (74.0, [34.0, 34.0])],
        "llama.cpp": [(75.0, [34.0, 34.0])],
    }
    fast = paired_by_period(samples)["periods"]["fast"]
    assert "llama.cpp" not in fast and not any(k.startswith("ratio") for k in fast)
