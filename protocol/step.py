"""Frontend -> ranks step plans and rank 0 -> frontend step results.

A plan is self-contained: a rank needs nothing from earlier steps but its KV cache contents.
"""

from __future__ import annotations

import sys
from typing import Annotated

import msgspec
from msgspec import Meta

# What a rank can hold: the sampler's settings and the ids a request contributes are checked
# against these when decoding, and by wire_error before a request is admitted.
Finite = Annotated[float, Meta(ge=-sys.float_info.max, le=sys.float_info.max)]
Int32 = Annotated[int, Meta(ge=-(2**31), lt=2**31)]
Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Meta(ge=0, lt=2**31)]


class SamplingSpec(msgspec.Struct, frozen=True, array_like=True):
    temperature: Finite = 1.0
    top_k: Int32 = 0
    top_p: Finite = 1.0
    min_p: Finite = 0.0
    repetition_penalty: Finite = 1.0
    presence_penalty: Finite = 0.0
    frequency_penalty: Finite = 0.0
    num_logprobs: Int32 = -1  # -1: none; 0: only the sampled token's logprob


class PromptScoring(msgspec.Struct, frozen=True, array_like=True):
    """Prompt logprobs wanted from this step: rows [first, first + count) of the work's
    token_ids are scored on the token that follows each (token_ids[row + 1], or next_token for
    the chunk's last row)."""

    first: Int32
    count: Int32
    num_top: Int32  # alternatives per position besides the scored token
    next_token: TokenId | None = None


class SeqWork(msgspec.Struct, frozen=True, array_like=True):
    seq_id: int
    token_ids: list[int]  # tokens computed this step
    start_pos: int  # position of token_ids[0]
    block_table: list[int]  # KV blocks covering positions [0, start_pos + len(token_ids))
    sample: bool  # the last token completes the sequence so far: sample the next one
    sampling: SamplingSpec | None = None
    seed: Int64 | None = None  # per-step seed derived by the frontend; None: engine randomness
    banned_token_ids: list[TokenId] = []  # e.g. EOS while min_tokens is not reached
    prompt_token_ids: list[int] = []  # only sent when penalties need the history
    output_token_ids: list[int] = []
    prompt_scoring: PromptScoring | None = None
    # Output grammar: bit t (LSB first, byte t // 8) set when token t may be sampled; tokens
    # past the mask (the model's padded vocabulary) may not. Empty: unconstrained.
    allowed_mask: bytes = b""
    # OpenAI logit_bias as parallel lists: bias_values[i] is added to token bias_token_ids[i].
    bias_token_ids: list[TokenId] = []
    bias_values: list[Finite] = []
    # Return this sequence's pooled embedding (StepResult.embeddings) instead of sampling a
    # token; its whole prompt is in this step.
    embed: bool = False


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


class PromptLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """One sequence's scored prompt positions of a step, in order. Logprobs travel as native
    float32 bytes (ranks and frontend share the machine); alternatives are flattened, num_top
    per position."""

    seq_id: int
    logprobs: bytes
    ranks: list[int]  # 1-based rank of each scored token among the raw logprobs
    top_token_ids: list[int] = []
    top_logprobs: bytes = b""


class Embedding(msgspec.Struct, frozen=True, array_like=True):
    """One sequence's pooled embedding: float32 little-endian, full dimension, pooled and
    normalised as the model says."""

    seq_id: int
    vector: bytes


class StepResult(msgspec.Struct, frozen=True, tag="result", omit_defaults=True):
    step_id: int
    tokens: list[SampledToken]
    forward_seconds: float = 0.0
    prompt_logprobs: list[PromptLogprobs] = []
    embeddings: list[Embedding] = []


_encoder = msgspec.msgpack.Encoder()
_work_decoder = msgspec.msgpack.Decoder(SeqWork)


def wire_error(work: SeqWork, check_ranges: bool = True) -> str | None:
    """Why `work` would not reach a rank as sent, or None when it would: a value msgpack cannot
    encode, or (with check_ranges) one the rank's decoder refuses."""
    try:
        data = _encoder.encode(work)
        if check_ranges:
            _work_decoder.decode(data)
    except (msgspec.MsgspecError, OverflowError, TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
