"""Prometheus families of constrained decoding, read from the engine's compiler at scrape
time: cpud_structured_requests_total{kind}, cpud_grammar_compile_seconds,
cpud_grammar_rejected_total{reason} and cpud_grammar_cache_bytes."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import accumulate

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from cpud.structured.compiler import COMPILE_BUCKETS, REJECTIONS, CompileStats

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
    rejected = CounterMetricFamily(
        "cpud_grammar_rejected",
        "Output constraints refused: invalid (malformed or past a grammar limit), timeout "
        "(compile too slow), busy (compile threads taken), cancelled (request ended first)",
        labels=["reason"],
    )
    for reason in REJECTIONS:
        rejected.add_metric([reason], stats.rejected.get(reason, 0))
    yield rejected
    yield GaugeMetricFamily(
        "cpud_grammar_cache_bytes",
        "Estimated memory held by the compiled-grammar cache",
        value=stats.cache_bytes,
    )
