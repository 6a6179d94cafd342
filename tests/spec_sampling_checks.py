"""What the speculative sampling tests share: a small Markov chain as the target, decoding it by
proposing and verifying, the chi-squared test against an expected distribution, and a fixture
model's own distribution of its next few tokens with the engine's samples of them."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from scipy.stats import chi2

from cpud import LLM, SamplingParams
from cpud.protocol.step import SamplingSpec, SeqWork, StepPlan
from cpud.ranks.sampler import SamplingRow
from cpud.ranks.spec_verify import verify

VOCAB = 6
K = 3
SIGNIFICANCE = 1e-3
# (last token, this step's seed) -> the K proposals, and the q each was drawn from [K, VOCAB]
# (None: proposals that were not sampled, a one-hot q)
Proposer = Callable[[int, int], tuple[list[int], torch.Tensor | None]]
NextProbs = Callable[[tuple[int, ...]], dict[int, float]]


def chain(seed: int = 1) -> torch.Tensor:
    """A Markov chain's next-token logits [VOCAB, VOCAB] (row: the previous token)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, VOCAB, generator=generator) * 1.5


def continuation(
    logits: torch.Tensor,
    start: int,
    seed: int,
    resample_residual: bool,
    propose: Proposer,
    length: int = 2,
) -> tuple[int, ...]:
    """The first `length` tokens of the chain after `start`, decoded by proposing and
    verifying."""
    tokens = [start]
    spec = SamplingSpec(temperature=1.0)
    step = 0
    while len(tokens) <= length:
        drafts, q = propose(tokens[-1], seed * 1000 + step)
        rows = [
            SamplingRow(0, spec, seed=seed * 1000 + step * 10 + j, draft_token=d)
            for j, d in enumerate([*drafts, None])
        ]
        previous = [tokens[-1], *drafts]
        emitted = verify(
            logits[previous],
            rows,
            torch.Generator(),
            resample_residual=resample_residual,
            draft_probs=q,
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


def random_prompt(llm: LLM, length: int = 8) -> list[int]:
    rng = random.Random(2)
    return [rng.randrange(4, llm.config.model.vocab_size) for _ in range(length)]


def model_next_probs(llm: LLM, prompt: list[int], top_k: int) -> NextProbs:
    """The model's own next-token distribution after prompt + an output so far, at temperature
    1 over its top_k tokens (from rank 0's logits, no sampling)."""
    runner = llm.engine.executor.runner

    def next_probs(output: tuple[int, ...]) -> dict[int, float]:
        plan = StepPlan(10**6, [SeqWork(10**6, [*prompt, *output], 0, list(range(4)), False)])
        values, ids = runner.prompt_logits(plan)[-1].float().topk(top_k)
        return dict(zip(ids.tolist(), values.softmax(-1).tolist()))

    return next_probs


def output_distribution(
    next_probs: NextProbs, length: int = 3
) -> tuple[dict[tuple[int, ...], float], dict[tuple[int, ...], int]]:
    """Every output of `length` tokens with its chance, and the likeliest next token after
    each shorter output."""
    expected: dict[tuple[int, ...], float] = {(): 1.0}
    likeliest = {}
    for _ in range(length):
        grown = {}
        for output, chance in expected.items():
            probs = next_probs(output)
            likeliest[output] = max(probs, key=probs.get)
            grown.update({(*output, t): chance * p for t, p in probs.items()})
        expected = grown
    return expected, likeliest


def sampled_outputs(llm: LLM, prompt: list[int], top_k: int, samples: int = 1200) -> Counter:
    """How often the engine, speculating, samples each 3-token output over `samples` seeds;
    every sequence verified a proposal, some accepted and some not."""
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
    return observed
