"""The sampler's grammar mask and logit_bias on crafted logits."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from cpud import SamplingParams
from cpud.engine.step_planner import sampling_spec
from cpud.protocol.step import NewSeq, wire_error
from cpud.ranks.penalty_counts import PenaltyCounts
from cpud.ranks.sampler import SamplingRow, allowed_tokens, sample

VOCAB = 70  # logits width: the model's vocabulary, padded past the tokenizer's 64


def pack(allowed: list[int], size: int = 64) -> bytes:
    bits = np.zeros(size, dtype=np.uint8)
    bits[allowed] = 1
    return np.packbits(bits, bitorder="little").tobytes()


def work(params: SamplingParams, mask: bytes = b"", bias=(), seed=None) -> SamplingRow:
    return SamplingRow(
        0,
        sampling_spec(params),
        seed,
        allowed_mask=mask,
        bias_token_ids=[t for t, _ in bias],
        bias_values=[b for _, b in bias],
    )


def test_mask_unpacks_lsb_first_and_forbids_columns_past_it():
    allowed = allowed_tokens(pack([0, 9, 63]), VOCAB)
    assert allowed.shape == (VOCAB,)
    assert allowed.nonzero()[0].tolist() == [0, 9, 63]


def test_greedy_picks_the_best_allowed_token():
    logits = torch.arange(VOCAB, dtype=torch.float32).unsqueeze(0)  # best: the last column
    tokens = sample(logits, [work(SamplingParams(temperature=0), pack([3, 17, 40]))], None)
    assert tokens[0].token_id == 40  # 69 is padding past the mask, 63 is not allowed


def test_sampling_never_leaves_the_mask():
    logits = torch.randn(400, VOCAB)
    params = SamplingParams(temperature=1.5, top_p=0.9)
    generator = torch.Generator().manual_seed(0)
    mask = pack([5, 6, 50])
    tokens = sample(logits, [work(params, mask)] * 400, generator)
    assert {t.token_id for t in tokens} == {5, 6, 50}


def test_penalties_cannot_revive_a_masked_token():
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = -5.0
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    row = work(params, pack([7]))
    row = dataclasses.replace(row, penalty=PenaltyCounts.of([], [3]))
    assert sample(logits, [row], None)[0].token_id == 7


def test_bias_bans_and_forces():
    logits = torch.zeros(1, VOCAB)
    logits[0, 12] = 30.0
    banned = sample(logits, [work(SamplingParams(temperature=0), bias=[(12, -100.0)])], None)
    assert banned[0].token_id != 12
    forced = sample(logits, [work(SamplingParams(temperature=0), bias=[(33, 100.0)])], None)
    assert forced[0].token_id == 33
    # a bias past the logits (a tokenizer id the model has no row for) is ignored
    assert (
        sample(logits, [work(SamplingParams(temperature=0), bias=[(99, 100.0)])], None)[0].token_id
        == 12
    )


def test_bias_then_mask_and_raw_logprobs():
    """Bias first, mask after: a forced token outside the mask still loses. Logprobs stay those
    of the model."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 1.0
    params = SamplingParams(temperature=0, logprobs=1)
    row = work(params, pack([2, 4]), bias=[(8, 100.0), (4, 5.0)])
    token = sample(logits, [row], None)[0]
    assert token.token_id == 4
    expected = torch.log_softmax(logits[0], -1)[4].item()
    assert token.logprob == pytest.approx(expected)
    assert token.top_token_ids == [2]


def test_constraints_touch_only_their_rows():
    logits = torch.randn(3, VOCAB)
    rows = [
        work(SamplingParams(temperature=0)),
        work(SamplingParams(temperature=0), pack([1]), bias=[(2, 3.0)]),
        work(SamplingParams(temperature=0)),
    ]
    tokens = [t.token_id for t in sample(logits.clone(), rows, None)]
    assert tokens[1] == 1
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())


def test_wire_checks_bias_values():
    def new_seq(bias):
        ids, values = [t for t, _ in bias], [b for _, b in bias]
        return NewSeq(0, sampling_spec(SamplingParams()), ids, values)

    assert wire_error(new_seq([(1, 2.0)])) is None
    assert wire_error(new_seq([(1, float("inf"))])) is not None
    assert wire_error(new_seq([(-1, 1.0)])) is not None
