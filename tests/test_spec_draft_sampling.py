"""Rejection sampling against a draft model's real q keeps the target's distribution:
chi-squared over many seeds at temperature 1 on a small vocabulary (the same test fails when
rejected positions are drawn from p instead of the residual max(p - q, 0)), and through the
engine with a draft model on a fixture."""

from __future__ import annotations

from collections import Counter

import pytest
import spec_sampling_checks as checks
import torch
from spec_sampling_checks import one_thread
from test_spec_draft import perturbed_copy

from cpud import LLM

__all__ = ["one_thread"]  # the fixture, used by name


def draft_chain(q_logits: torch.Tensor):
    """K proposals drawn from the draft chain, and the q each was drawn from [K, V]."""

    def propose(last: int, step_seed: int) -> tuple[list[int], torch.Tensor]:
        generator = torch.Generator().manual_seed(step_seed)
        drafts, q = [], []
        for _ in range(checks.K):
            probs = q_logits[last].softmax(-1)
            last = int(torch.multinomial(probs, 1, generator=generator))
            drafts.append(last)
            q.append(probs)
        return drafts, torch.stack(q)

    return propose


@pytest.mark.slow
@pytest.mark.parametrize("resample_residual", [True, False])
def test_samples_follow_the_target_with_a_draft_q(resample_residual, one_thread):
    target, draft = checks.chain(1), checks.chain(2)  # q far from p: many rejections
    samples = 1500  # the wrong verifier's p-value is ~1e-137 at 2500
    propose = draft_chain(draft)
    observed = Counter(
        checks.continuation(target, 0, s, resample_residual, propose) for s in range(samples)
    )
    p_value = checks.chi_squared_p(observed, checks.target_pairs(target, 0), samples)
    if resample_residual:
        assert p_value > checks.SIGNIFICANCE
    else:  # a rejected position drawn from p comes back as q's likely tokens too often
        assert p_value < checks.SIGNIFICANCE


def test_seeded_rows_verify_the_same_way_every_time():
    target, draft = checks.chain(1), checks.chain(2)
    propose = draft_chain(draft)
    runs = {checks.continuation(target, 3, 17, True, propose, length=6) for _ in range(3)}
    assert len(runs) == 1


@pytest.mark.slow
def test_engine_samples_follow_the_model_with_a_draft_model(model_factory, tmp_path, one_thread):
    """The whole path (placeholders planned, the rank's draft sampling its q, rank 0's
    verification) on a fixture: three tokens after a prompt at temperature 1, top_k 3, over
    1200 seeds, against the model's own logits."""
    target = model_factory("qwen3")
    # noise 0.1: about 2 in 3 proposals accepted; drawing rejected positions from p instead of
    # the residual gives p ~ 1e-4 here
    draft = perturbed_copy(target, tmp_path / "draft", 0.1)
    config = {
        "method": "draft_model",
        "model": str(draft),
        "num_speculative_tokens": 2,
        "disable_by_batch_size": 4096,
    }
    llm = LLM(target, dtype="float32", max_model_len=64, speculative_config=config)
    prompt = checks.random_prompt(llm)
    top_k = 3
    expected, _ = checks.output_distribution(checks.model_next_probs(llm, prompt, top_k))
    samples = 1200
    observed = checks.sampled_outputs(llm, prompt, top_k, samples)
    assert checks.chi_squared_p(observed, expected, samples) > checks.SIGNIFICANCE
