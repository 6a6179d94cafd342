"""Rejection sampling against a draft model's real q keeps the target's distribution:
chi-squared over many seeds at temperature 1 on a small vocabulary (the same test fails when
rejected positions are drawn from p instead of the residual max(p - q, 0)), and through the
engine with a draft model on a fixture."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from test_spec_draft import perturbed_copy
from test_spec_sampling import SIGNIFICANCE, K, chain, chi_squared_p, one_thread, target_pairs

from cpud import LLM, SamplingParams
from cpud.protocol.step import SamplingSpec, SeqWork, StepPlan
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
    rng = random.Random(2)
    prompt = [rng.randrange(4, llm.config.model.vocab_size) for _ in range(8)]
    top_k = 3
    runner = llm.engine.executor.runner

    def next_probs(output: tuple[int, ...]) -> dict[int, float]:
        plan = StepPlan(10**6, [SeqWork(10**6, [*prompt, *output], 0, list(range(4)), False)])
        values, ids = runner.prompt_logits(plan)[-1].float().topk(top_k)
        return dict(zip(ids.tolist(), values.softmax(-1).tolist()))

    expected: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(3):
        expected = {
            (*output, t): chance * p
            for output, chance in expected.items()
            for t, p in next_probs(output).items()
        }
    samples = 1200
    params = [
        SamplingParams(n=120, seed=11 + i, temperature=1.0, top_k=top_k, max_tokens=3)
        for i in range(samples // 120)
    ]
    results = llm.generate([prompt] * len(params), params)
    observed = Counter(tuple(o.token_ids) for r in results for o in r.outputs)
    assert sum(observed.values()) == samples
    stats = llm.engine.spec.stats
    assert stats.num_drafts >= samples
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert chi_squared_p(observed, expected, samples) > SIGNIFICANCE
