"""A data-parallel replica's metrics carry a `replica` label: its frontend exposes its registry
through ReplicaLabelled, so one Prometheus job scraping every replica tells them apart (and
sums them) without relabelling rules."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

REPLICA_LABEL = "replica"


class ReplicaLabelled(Collector):
    """`registry`'s metrics, each sample with replica="<index>" added."""

    def __init__(self, registry: Collector, replica: int):
        self.registry = registry
        self.value = str(replica)

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            labelled = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            labelled.samples = [
                sample._replace(labels={**sample.labels, REPLICA_LABEL: self.value})
                for sample in metric.samples
            ]
            yield labelled


def exposed(registry: Collector, replica: int | None) -> Collector:
    """What /metrics exposes: the registry, labelled when it belongs to a replica."""
    return registry if replica is None else ReplicaLabelled(registry, replica)
