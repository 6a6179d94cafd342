"""A rank's per-step work outside the forward pass does not grow with the sequence: a penalised
decode step converts as many Python values to tensors and allocates as many Python bytes at
10,000 tokens of history as at 100 (counted, not timed), and penalty counts kept step by step,
proposals rewound included, penalise exactly as counts taken from the whole history."""

from __future__ import annotations

import random
import tracemalloc

import torch

from cpud.protocol.step import NewSeq, SamplingSpec, SeqWork, StepPlan
from cpud.ranks.penalty_counts import PenaltyCounts
from cpud.ranks.sampler import sample
from cpud.ranks.seq_states import SeqStates
from cpud.ranks.step_inputs import build_step_inputs

BLOCK = 16
VOCAB = 3000
PENALISED = SamplingSpec(
    temperature=0.8, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3
)


def decode_step_cost(length: int, monkeypatch) -> tuple[int, int]:
    """(values converted from Python sequences to tensors, peak Python bytes) of one penalised
    decode step on a rank holding a sequence of `length` tokens, from plan to sampled token."""
    rng = random.Random(length)
    history = [rng.randrange(VOCAB) for _ in range(length)]
    num_blocks = length // BLOCK + 2
    states = SeqStates()
    logits = torch.randn(1, VOCAB)
    generator = torch.Generator().manual_seed(0)

    def step(plan: StepPlan) -> None:
        inputs = build_step_inputs(plan, states.apply(plan), BLOCK)
        sample(logits.clone(), inputs.sampling_rows, generator)

    new = NewSeq(7, PENALISED, history=history, num_prompt_tokens=length // 2)
    step(StepPlan(0, [SeqWork(7, [1], length, list(range(num_blocks)), True)], [new]))
    step(StepPlan(1, [SeqWork(7, [2], None, [], True, seed=5)]))  # warm: every table grown
    converted = 0
    real_tensor = torch.tensor

    def counting_tensor(data, *args, **kwargs):
        nonlocal converted
        if isinstance(data, (list, tuple)):
            converted += len(data)
        return real_tensor(data, *args, **kwargs)

    monkeypatch.setattr(torch, "tensor", counting_tensor)
    tracemalloc.start()
    try:
        step(StepPlan(2, [SeqWork(7, [3], None, [], True, seed=6)]))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        monkeypatch.undo()
    return converted, peak


def test_a_penalised_decode_step_costs_the_same_at_any_length(monkeypatch):
    short_converted, short_peak = decode_step_cost(100, monkeypatch)
    long_converted, long_peak = decode_step_cost(10_000, monkeypatch)
    assert long_converted == short_converted, (short_converted, long_converted)
    # 10,000 tokens of history copied once would take 80 kB.
    assert long_peak - short_peak < 8_000, (short_peak, long_peak)


def test_counts_kept_step_by_step_penalise_as_the_whole_history():
    rng = random.Random(3)
    num_prompt = 40
    history = [rng.randrange(VOCAB) for _ in range(num_prompt)]
    kept = PenaltyCounts(num_prompt, history)
    kept.sync()
    for _ in range(60):
        history.extend(rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6)))
        kept.sync()
        if rng.random() < 0.4:  # proposals rejected: the rank goes back past them
            start = len(history) - rng.randrange(0, min(4, len(history) - num_prompt) + 1)
            kept.unwind(start)
            del history[start:]
    logits = torch.randn(VOCAB + 8)  # the model's padded vocabulary: ids past the counts
    expected, got = logits.clone(), logits.clone()
    proposals = history[-3:]
    PenaltyCounts.of(history[:num_prompt], history[num_prompt:-3]).apply(expected, PENALISED)
    kept.apply(got, PENALISED, uncounted=proposals)
    assert torch.equal(expected, got)
    assert not torch.equal(expected, logits)
