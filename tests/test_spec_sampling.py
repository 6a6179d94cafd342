"""Rejection sampling of speculative proposals keeps the target's distribution: chi-squared
over many seeds at temperature 1, and the same test fails when rejected positions are drawn
from p instead of the residual (the test can tell a wrong verifier)."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
from spec_sampling_checks import (
    SIGNIFICANCE,
    K,
    chain,
    chi_squared_p,
    continuation,
    model_next_probs,
    one_thread,
    output_distribution,
    random_prompt,
    sampled_outputs,
    target_pairs,
)

from cpud import LLM
from cpud.engine import spec_decode
from cpud.ranks import spec_verify
from cpud.ranks.sampler import SamplingRow
from cpud.ranks.spec_verify import verify

__all__ = ["one_thread"]  # the fixture, used by name


def target_argmax(logits: torch.Tensor):
    """K proposals: each the target's most likely next token (often right, often not)."""

    def propose(last: int, step_seed: int) -> tuple[list[int], None]:
        drafts = []
        for _ in range(K):
            last = int(logits[last].argmax())
            drafts.append(last)
        return drafts, None

    return propose


@pytest.mark.slow
@pytest.mark.parametrize("resample_residual", [True, False])
def test_verified_samples_follow_the_target_distribution(resample_residual, one_thread):
    logits = chain()
    start = 0
    samples = 2500
    propose = target_argmax(logits)
    observed = Counter(
        continuation(logits, start, s, resample_residual, propose) for s in range(samples)
    )
    p_value = chi_squared_p(observed, target_pairs(logits, start), samples)
    if resample_residual:
        assert p_value > SIGNIFICANCE
    else:  # without the correction a rejected proposal comes back too often
        assert p_value < SIGNIFICANCE


def test_greedy_rows_accept_while_equal():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0], [1.0, 0.0, 0.0]])
    rows = [SamplingRow(7, None, draft_token=d) for d in (1, 0, 1)] + [SamplingRow(7)]
    # argmax per row: 1, 0, 2, 0 -> accepts 1, 0, then 2 differs from proposal 1
    assert [t.token_id for t in verify(logits, rows, torch.Generator())] == [1, 0, 2]
    rows = [SamplingRow(7, None, draft_token=d) for d in (1, 0, 2)] + [SamplingRow(7)]
    assert [t.token_id for t in verify(logits, rows, torch.Generator())] == [1, 0, 2, 0]


class FollowerIndex:
    """Proposes the model's likeliest next token after each output so far it knows."""

    def __init__(self, prompt: list[int], likeliest: dict[tuple[int, ...], int]) -> None:
        self.prompt = prompt
        self.likeliest = likeliest

    def propose(self, tokens: list[int], k: int) -> list[int]:
        best = self.likeliest.get(tuple(tokens[len(self.prompt) :]))
        return [best] if best is not None else []


@pytest.mark.slow
@pytest.mark.parametrize("resample_residual", [True, False])
def test_engine_samples_follow_the_model_at_temperature_one(
    model_factory, monkeypatch, one_thread, resample_residual
):
    """The whole path (scheduler, plans, rank 0's verification) on a fixture: three tokens
    after a prompt (the last two speculated), top_k 3 at temperature 1, over 1200 seeds,
    against the model's own logits."""
    model_dir = model_factory("qwen3")
    config = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 4096}
    llm = LLM(model_dir, dtype="float32", max_model_len=64, speculative_config=config)
    prompt = random_prompt(llm)
    top_k = 3
    expected, likeliest = output_distribution(model_next_probs(llm, prompt, top_k))
    index = FollowerIndex(prompt, likeliest)
    monkeypatch.setattr(spec_decode, "NgramIndex", lambda n_min, n_max: index)
    if not resample_residual:
        wrong = functools.partial(spec_verify.verify, resample_residual=False)
        monkeypatch.setattr(spec_verify, "verify", wrong)
    samples = 1200
    observed = sampled_outputs(llm, prompt, top_k, samples)
    p_value = chi_squared_p(observed, expected, samples)
    assert p_value > SIGNIFICANCE if resample_residual else p_value < SIGNIFICANCE
