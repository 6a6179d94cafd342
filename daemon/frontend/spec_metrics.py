"""Prometheus series of speculative decoding (only when it is on): proposals, acceptances per
position and the mean accepted length, as vLLM's spec_decode counters."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from cpud.engine.spec_decode import SpecDecoder


def spec_families(spec: SpecDecoder | None) -> Iterator:
    if spec is None:
        return
    stats = spec.stats
    yield CounterMetricFamily(
        "cpud_spec_decode_num_drafts",
        "Steps in which a sequence verified speculative proposals",
        stats.num_drafts,
    )
    yield CounterMetricFamily(
        "cpud_spec_decode_num_draft_tokens", "Speculative tokens proposed", stats.num_draft_tokens
    )
    yield CounterMetricFamily(
        "cpud_spec_decode_num_accepted_tokens",
        "Speculative tokens accepted",
        stats.num_accepted_tokens,
    )
    per_position = CounterMetricFamily(
        "cpud_spec_decode_num_accepted_tokens_per_pos",
        "Speculative tokens accepted at each proposal position (0: the first)",
        labels=["position"],
    )
    for position, count in enumerate(list(stats.accepted_per_position)):
        per_position.add_metric([str(position)], count)
    yield per_position
    yield GaugeMetricFamily(
        "cpud_spec_decode_mean_accepted_length",
        "Tokens a verifying step yields per sequence on average (accepted proposals + 1)",
        stats.mean_accepted_length,
    )
