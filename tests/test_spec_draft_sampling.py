"""Rejection sampling against a draft model's real q keeps the target's distribution:
chi-squared over many seeds at temperature 1 on a small vocabulary, and the same test fails
when rejected positions are drawn from p instead of the residual max(p - q, 0)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from test_spec_sampling import SIGNIFICANCE, K, chain, chi_squared_p, one_thread, target_pairs

from cpud.protocol.step import SamplingSpec
from cpud.ranks.sampler import SamplingRow
from cpud.ranks.spec_verify import verify

__all__ = ["one_thread"]  # the fixture, used by name


def drafted(q_logits: torch.Tensor, last: int, generator: torch.Generator):
    """K proposals drawn from the draft chain, and the q each was drawn from [K, V]."""
    drafts, q = [], []
    for _ in range(K):
        probs = q_logits[last].softmax(-1)
        last = int(torch.multinomial(probs, 1, generator=generator))
        drafts.append(last)
        q.append(probs)
    return drafts, torch.stack(q)


def continuation(p_logits, q_logits, start, seed, resample_residual, length=2):
    tokens = [start]
    spec = SamplingSpec(temperature=1.0)
    step = 0
    while len(tokens) <= length:
        generator = torch.Generator().manual_seed(seed * 1000 + step)
        drafts, q = drafted(q_logits, tokens[-1], generator)
        rows = [
            SamplingRow(0, spec, seed=seed * 1000 + step * 10 + j, draft_token=d)
            for j, d in enumerate([*drafts, None])
        ]
        previous = [tokens[-1], *drafts]
        emitted = verify(
            p_logits[previous],
            rows,
            torch.Generator(),
            resample_residual=resample_residual,
            draft_probs=q,
        )
        tokens += [e.token_id for e in emitted]
        step += 1
    return tuple(tokens[1 : length + 1])


@pytest.mark.slow
@pytest.mark.parametrize("resample_residual", [True, False])
def test_samples_follow_the_target_with_a_draft_q(resample_residual, one_thread):
    target, draft = chain(1), chain(2)  # q far from p: many rejections
    samples = 1500  # the wrong verifier's p-value is ~1e-137 at 2500
    observed = Counter(continuation(target, draft, 0, s, resample_residual) for s in range(samples))
    p_value = chi_squared_p(observed, target_pairs(target, 0), samples)
    if resample_residual:
        assert p_value > SIGNIFICANCE
    else:  # a rejected position drawn from p comes back as q's likely tokens too often
        assert p_value < SIGNIFICANCE


def test_seeded_rows_verify_the_same_way_every_time():
    target, draft = chain(1), chain(2)
    runs = {continuation(target, draft, 3, 17, True, length=6) for _ in range(3)}
    assert len(runs) == 1
