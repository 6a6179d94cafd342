"""Frontend -> ranks step plans and rank 0 -> frontend step results.

Plans are deltas, as vLLM v1's NewRequestData / CachedRequestData: what stays the same for a
sequence's life (its sampling settings, logit bias, the token history penalties need) goes to
the ranks once, in a NewSeq, when it is first scheduled (and again after a preemption); each
step then carries per sequence only its new tokens and new KV blocks (SeqWork), and the ids of
the sequences the ranks stop holding (finished, aborted, preempted). The ranks keep each
sequence's block table, position and history, so what a decode step sends does not grow with
the sequence's length.
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


class NewSeq(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """A sequence the ranks start holding: what stays the same for its life, sent once."""

    seq_id: int
    sampling: SamplingSpec | None = None  # None: greedy, no logprobs
    # OpenAI logit_bias as parallel lists: bias_values[i] is added to token bias_token_ids[i].
    bias_token_ids: list[TokenId] = []
    bias_values: list[Finite] = []
    # Only when penalties need the history: the tokens before its first work's token_ids
    # (prompt and output so far), and how many tokens of the whole sequence are its prompt's.
    history: list[TokenId] = []
    num_prompt_tokens: int = 0


class SeqWork(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """One sequence's part of a step. With start_pos, its tokens start there and block_ids is
    its whole block table (a sequence the ranks do not hold yet starts so); without, it goes
    on where its last step ended and block_ids are blocks appended to its table."""

    seq_id: int
    token_ids: list[int]  # tokens computed this step
    start_pos: int | None  # position of token_ids[0]; None: where the last step ended
    block_ids: list[int]  # the whole table (start_pos given) or new blocks (None)
    sample: bool  # the last token completes the sequence so far: sample the next one
    seed: Int64 | None = None  # per-step seed derived by the frontend; None: engine randomness
    banned_token_ids: list[TokenId] = []  # e.g. EOS while min_tokens is not reached
    prompt_scoring: PromptScoring | None = None
    # Output grammar: bit t (LSB first, byte t // 8) set when token t may be sampled; tokens
    # past the mask (the model's padded vocabulary) may not. Empty: unconstrained.
    allowed_mask: bytes = b""
    # Return this sequence's pooled embedding (StepResult.embeddings) instead of sampling a
    # token; its whole prompt is in this step.
    embed: bool = False
    # Speculative decoding: the last num_draft of token_ids are proposals; rank 0 verifies
    # them (returns the accepted ones and one token of its own, several SampledTokens). rewind:
    # positions at the end of the previous step that were rejected, dropped before this one.
    num_draft: Int32 = 0
    rewind: Int32 = 0
    draft_masks: list[bytes] = []  # grammar masks of the positions after each proposal
    draft_seeds: list[Int64] = []  # seeds of the positions after each proposal (seeded rows)


class StepPlan(msgspec.Struct, frozen=True, tag="step", omit_defaults=True):
    step_id: int
    seqs: list[SeqWork]
    new_seqs: list[NewSeq] = []  # taken before seqs; a held sequence named again is replaced
    dropped: list[int] = []  # sequences the ranks stop holding, before new_seqs are taken


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
_decoders = {kind: msgspec.msgpack.Decoder(kind) for kind in (SeqWork, NewSeq)}


def wire_error(item: SeqWork | NewSeq, check_ranges: bool = True) -> str | None:
    """Why `item` would not reach a rank as sent, or None when it would: a value msgpack cannot
    encode, or (with check_ranges) one the rank's decoder refuses."""
    try:
        data = _encoder.encode(item)
        if check_ranges:
            _decoders[type(item)].decode(data)
    except (msgspec.MsgspecError, OverflowError, TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
