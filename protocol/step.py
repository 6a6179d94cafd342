"""Frontend -> ranks step plans and rank 0 -> frontend step results.

A plan is self-contained: a rank needs nothing from earlier steps but its KV cache contents.
"""

from __future__ import annotations

import msgspec


class SamplingSpec(msgspec.Struct, frozen=True, array_like=True):
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    num_logprobs: int = -1  # -1: none; 0: only the sampled token's logprob


class SeqWork(msgspec.Struct, frozen=True, array_like=True):
    seq_id: int
    token_ids: list[int]  # tokens computed this step
    start_pos: int  # position of token_ids[0]
    block_table: list[int]  # KV blocks covering positions [0, start_pos + len(token_ids))
    sample: bool  # the last token completes the sequence so far: sample the next one
    sampling: SamplingSpec | None = None
    seed: int | None = None  # per-step seed derived by the frontend; None: engine randomness
    banned_token_ids: list[int] = []  # e.g. EOS while min_tokens is not reached
    prompt_token_ids: list[int] = []  # only sent when penalties need the history
    output_token_ids: list[int] = []


class StepPlan(msgspec.Struct, frozen=True, tag="step"):
    step_id: int
    seqs: list[SeqWork]


class SampledToken(msgspec.Struct, frozen=True, array_like=True):
    seq_id: int
    token_id: int
    logprob: float | None = None
    rank: int | None = None  # 1-based rank of the sampled token among the raw logprobs
    top_token_ids: list[int] = []
    top_logprobs: list[float] = []


class StepResult(msgspec.Struct, frozen=True, tag="result"):
    step_id: int
    tokens: list[SampledToken]
    forward_seconds: float = 0.0
