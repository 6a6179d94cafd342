"""One generated continuation (or one embedding request's prompt): its tokens, progress, KV
blocks and text so far."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from cpud.engine.block_manager import BlockTable, salt_root
from cpud.engine.detokenizer import IncrementalDetokenizer
from cpud.engine.outputs import Logprob
from cpud.engine.sampling_params import SamplingParams
from cpud.structured.matcher import SequenceConstraint


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# One position's logprobs as users get them: its token first, then the top alternatives by
# rank. Built once, when the position is computed, and kept.
LogprobEntry = dict[int, Logprob]


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n choices
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    seed: int | None
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    blocks: BlockTable = field(default_factory=BlockTable)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Logprob entries of output tokens not yet handed out in an output (then cleared).
    new_logprobs: list[LogprobEntry] = field(default_factory=list)
    num_emitted_tokens: int = 0  # output tokens handed out in outputs so far
    # What the ranks hold of it (plans are deltas): whether they hold it since its NewSeq,
    # and how many of its blocks they have.
    on_ranks: bool = False
    blocks_on_ranks: int = 0
    emitted_finish: bool = False  # the output with its finish reason went out
    prompt_logprobs: list[LogprobEntry] = field(default_factory=list)  # of prompt tokens 1..
    cumulative_logprob: float = 0.0
    num_preemptions: int = 0
    first_token_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served at first admission
    constraint: SequenceConstraint | None = None  # the output grammar's state, if any
    max_tokens: int = 2**31 - 1  # output budget: the request's, else the context's room
    # An embedding request: its whole prompt runs in one step, which returns its pooled vector
    # instead of a token; its KV blocks (decoders only) are freed after that step.
    embed: bool = False
    embedding: list[float] | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.blocks.root = salt_root(self.params.cache_salt)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def scores_prompt(self) -> bool:
        """Whether this sequence computes its request's prompt logprobs (the first choice does)."""
        return self.params.prompt_logprobs is not None and self.index == 0

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs still to compute: the prefix cache is bypassed until they are done."""
        return self.scores_prompt and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
