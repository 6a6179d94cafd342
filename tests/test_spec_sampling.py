"""Rejection sampling of speculative proposals keeps the target's distribution: chi-squared
over many seeds at temperature 1, and the same test fails when rejected positions are drawn
from p instead of the residual (the test can tell a wrong verifier)."""

from __future__ import annotations

import functools
import random
from collections import Counter

import pytest
import torch
from scipy.stats import chi2

from cpud import LLM, SamplingParams
from cpud.engine import spec_decode
from cpud.protocol.step import SamplingSpec, SeqWork, StepPlan
from cpud.ranks import spec_verify
from cpud.ranks.sampler import SamplingRow
from cpud.ranks.spec_verify import verify

VOCAB = 6
K = 3
SIGNIFICANCE = 1e-3


def chain(seed: int = 1) -> torch.Tensor:
    """A Markov chain's next-token logits [VOCAB, VOCAB] (row: the previous token)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, VOCAB, generator=generator) * 1.5


def propose(last: int, logits: torch.Tensor) -> list[int]:
    """K proposals: each the target's most likely next token (often right, often not)."""
    drafts = []
    for _ in range(K):
        last = int(logits[last].argmax())
        drafts.append(last)
    return drafts


def continuation(logits, start, seed, resample_residual, length=2) -> tuple[int, ...]:
    """The first `length` tokens after `start`, decoded by proposing and verifying."""
    tokens = [start]
    spec = SamplingSpec(temperature=1.0)
    step = 0
    while len(tokens) <= length:
        drafts = propose(tokens[-1], logits)
        previous = [tokens[-1], *drafts]
        rows = [
            SamplingRow(0, spec, seed=seed * 1000 + step * 10 + j, draft_token=d)
            for j, d in enumerate([*drafts, None])
        ]
        emitted = verify(
            logits[previous], rows, torch.Generator(), resample_residual=resample_residual
        )
        tokens += [e.token_id for e in emitted]
        step += 1
    return tuple(tokens[1 : length + 1])


def chi_squared_p(observed: Counter, expected: dict, samples: int) -> float:
    cells = [c for c in expected if expected[c] * samples >= 5]
    rest = 1.0 - sum(expected[c] for c in cells)
    statistic = sum(
        (observed[c] - samples * expected[c]) ** 2 / (samples * expected[c]) for c in cells
    )
    other = samples - sum(observed[c] for c in cells)
    degrees = len(cells) - 1
    if rest * samples >= 5:
        statistic += (other - samples * rest) ** 2 / (samples * rest)
        degrees += 1
    return float(chi2.sf(statistic, degrees))


def target_pairs(logits: torch.Tensor, start: int) -> dict:
    probs = logits.softmax(-1)
    return {
        (a, b): float(probs[start, a] * probs[a, b]) for a in range(VOCAB) for b in range(VOCAB)
    }


@pytest.fixture
def one_thread():
    """torch on one thread: these tiny tensors are far slower on a busy shared machine's
    thread pool."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("resample_residual", [True, False])
def test_verified_samples_follow_the_target_distribution(resample_residual, one_thread):
    logits = chain()
    start = 0
    samples = 2500
    observed = Counter(continuation(logits, start, s, resample_residual) for s in range(samples))
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
    rng = random.Random(2)
    prompt = [rng.randrange(4, llm.config.model.vocab_size) for _ in range(8)]
    top_k = 3
    runner = llm.engine.executor.runner

    def next_probs(output: tuple[int, ...]) -> dict[int, float]:
        plan = StepPlan(10**6, [SeqWork(10**6, [*prompt, *output], 0, list(range(4)), False)])
        values, ids = runner.prompt_logits(plan)[-1].float().topk(top_k)
        return dict(zip(ids.tolist(), values.softmax(-1).tolist()))

    expected: dict[tuple[int, ...], float] = {(): 1.0}
    likeliest = {}
    for _ in range(3):
        grown = {}
        for output, chance in expected.items():
            probs = next_probs(output)
            likeliest[output] = max(probs, key=probs.get)
            grown.update({(*output, t): chance * p for t, p in probs.items()})
        expected = grown
    index = FollowerIndex(prompt, likeliest)
    monkeypatch.setattr(spec_decode, "NgramIndex", lambda n_min, n_max: index)
    if not resample_residual:
        wrong = functools.partial(spec_verify.verify, resample_residual=False)
        monkeypatch.setattr(spec_verify, "verify", wrong)
    samples = 1200
    params = [
        SamplingParams(n=120, seed=11 + i, temperature=1.0, top_k=top_k, max_tokens=3)
        for i in range(samples // 120)
    ]
    results = llm.generate([prompt] * len(params), params)
    observed = Counter(tuple(o.token_ids) for r in results for o in r.outputs)
    assert sum(observed.values()) == samples
    stats = llm.engine.spec.stats
    assert stats.num_drafts >= samples  # every sequence's second token verified a proposal
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    p_value = chi_squared_p(observed, expected, samples)
    assert p_value > SIGNIFICANCE if resample_residual else p_value < SIGNIFICANCE
