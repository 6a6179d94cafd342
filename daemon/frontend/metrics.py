"""Prometheus metrics of the frontend: request counters and latency histograms it observes,
plus engine gauges read at scrape time. One registry per server, no process globals."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cpud.frontend.async_engine import AsyncEngine
from cpud.frontend.spec_metrics import spec_families
from cpud.replicas_metrics import exposed
from cpud.structured.metrics import structured_families

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


RANK_LABELS = ["rank", "numa_node"]
RANK_SERIES = (
    # (name, help, kind, RankStats field)
    ("cpud_rank_steps", "Steps the rank executed", "counter", "steps"),
    (
        "cpud_rank_step_seconds",
        "Time spent executing steps",
        "counter",
        "step_seconds",
    ),
    ("cpud_rank_allreduce_seconds", "Wall time in all-reduce", "counter", "allreduce_seconds"),
    ("cpud_rank_threads", "OpenMP threads the rank runs", "gauge", "threads"),
    ("cpud_rank_threads_bound", "Threads pinned to their planned CPU", "gauge", "threads_bound"),
    (
        "cpud_rank_threads_busy",
        "Threads that ran since the last report",
        "gauge",
        "threads_busy",
    ),
    ("cpud_rank_resident_bytes", "Resident memory of the rank process", "gauge", "resident_bytes"),
    ("cpud_rank_kv_cache_bytes", "KV cache allocated by the rank", "gauge", "kv_bytes"),
)


def rank_families(stats: list) -> Iterator:
    for name, help_text, kind, field in RANK_SERIES:
        family_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        family = family_type(name, help_text, labels=RANK_LABELS)
        for entry in stats:
            node = "" if entry.numa_node is None else str(entry.numa_node)
            family.add_metric([str(entry.rank), node], getattr(entry, field))
        yield family


class EngineCollector(Collector):
    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    def collect(self) -> Iterator:
        stats = self.engine.stats()
        yield GaugeMetricFamily("cpud_requests_running", "Sequences being computed", stats.running)
        yield GaugeMetricFamily(
            "cpud_requests_waiting", "Sequences waiting for KV room", stats.waiting
        )
        yield GaugeMetricFamily(
            "cpud_kv_cache_usage_ratio", "Fraction of KV blocks in use (0-1)", stats.kv_usage
        )
        yield CounterMetricFamily(
            "cpud_prefix_cache_queries",
            "Full prompt blocks looked up in the prefix cache",
            stats.prefix_queries,
        )
        yield CounterMetricFamily(
            "cpud_prefix_cache_hits", "Prompt blocks found in the prefix cache", stats.prefix_hits
        )
        yield CounterMetricFamily(
            "cpud_preemptions",
            "Sequences preempted (recomputed) for lack of KV blocks",
            stats.preemptions,
        )
        yield CounterMetricFamily("cpud_engine_steps", "Engine steps run", stats.steps)
        yield from rank_families(self.engine.engine.executor.rank_stats())
        yield CounterMetricFamily(
            "cpud_engine_step_seconds", "Wall time spent in engine steps", stats.step_seconds
        )
        yield from structured_families(self.engine.engine.grammars.stats())
        yield from spec_families(self.engine.engine.spec)


class FrontendMetrics:
    def __init__(self, replica: int | None = None):
        self.registry = CollectorRegistry()
        self.exposed = exposed(self.registry, replica)  # what /metrics shows
        self.requests = Counter(
            "cpud_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "cpud_time_to_first_token_seconds",
            "Time from request arrival to its first generated token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token = Histogram(
            "cpud_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a sequence",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "cpud_e2e_request_latency_seconds",
            "Time from request arrival to its last token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "cpud_prompt_tokens", "Prompt tokens of finished requests", registry=self.registry
        )
        self.embedding_inputs = Counter(
            "cpud_embedding_inputs",
            "Inputs embedded by /v1/embeddings (each one engine request)",
            registry=self.registry,
        )
        self.embedding_latency = Histogram(
            "cpud_embedding_request_latency_seconds",
            "Time from an embeddings request's arrival to its last vector",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "cpud_generation_tokens",
            "Generated tokens of finished requests",
            registry=self.registry,
        )

    def watch(self, engine: AsyncEngine) -> None:
        self.registry.register(EngineCollector(engine))
