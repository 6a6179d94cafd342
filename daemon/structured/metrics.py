"""Prometheus families of constrained decoding, read from the engine's compiler at scrape
time: cpud_structured_requests_total{kind} and cpud_grammar_compile_seconds."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import accumulate

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from cpud.structured.compiler import COMPILE_BUCKETS, CompileStats

KINDS = ("json", "regex", "choice", "grammar")


def structured_families(stats: CompileStats) -> Iterator:
    requests = CounterMetricFamily(
        "cpud_structured_requests",
        "Requests admitted with an output constraint, by kind",
        labels=["kind"],
    )
    for kind in KINDS:
        requests.add_metric([kind], stats.requests.get(kind, 0))
    yield requests
    cumulative = list(accumulate(stats.compile_counts))
    bounds = [str(b) for b in COMPILE_BUCKETS] + ["+Inf"]
    yield HistogramMetricFamily(
        "cpud_grammar_compile_seconds",
        "Time to compile an output constraint (cache misses only)",
        buckets=list(zip(bounds, cumulative)),
        sum_value=stats.compile_seconds,
    )
