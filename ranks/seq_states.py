"""What a rank keeps per sequence between steps: the plans are deltas (protocol/step.py), so
the block table (a list and a tensor row grown with each step's new blocks), the position the
next step starts at, the sampling settings and, when penalties need them, the token history
and its counts live here from the sequence's NewSeq until the plan drops it (finished,
aborted, preempted)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cpud.protocol.step import NewSeq, SamplingSpec, SeqWork, StepPlan
from cpud.ranks.penalty_counts import PenaltyCounts


def uses_penalties(spec: SamplingSpec | None) -> bool:
    return spec is not None and (
        spec.repetition_penalty != 1.0
        or spec.presence_penalty != 0.0
        or spec.frequency_penalty != 0.0
    )


class BlockRow:
    """A block table as an int32 tensor that grows by the blocks appended to its list: a step
    copies only its new block ids, never the whole table."""

    def __init__(self) -> None:
        self._ids = torch.zeros(0, dtype=torch.int32)
        self.length = 0  # list entries copied

    def reset(self) -> None:
        """The list was replaced: copy it again from its start."""
        self.length = 0

    def view(self, table: list[int]) -> torch.Tensor:
        """The row [len(table)], after copying the entries appended since the last call."""
        if len(table) < self.length:
            self.length = 0
        if len(table) > self.length:
            if len(table) > self._ids.shape[0]:
                grown = torch.zeros(max(len(table), 2 * self._ids.shape[0]), dtype=torch.int32)
                grown[: self.length] = self._ids[: self.length]
                self._ids = grown
            self._ids[self.length : len(table)] = torch.tensor(
                table[self.length :], dtype=torch.int32
            )
            self.length = len(table)
        return self._ids[: self.length]


@dataclass
class HeldSeq:
    block_table: list[int] = field(default_factory=list)
    position: int = 0  # tokens computed so far: where the next step without start_pos begins
    step_start: int = 0  # where this step's tokens begin
    sampling: SamplingSpec | None = None
    bias_token_ids: list[int] = field(default_factory=list)
    bias_values: list[float] = field(default_factory=list)
    history: list[int] | None = None  # every token so far, kept only for penalties
    num_prompt_tokens: int = 0
    counts: PenaltyCounts | None = None  # the history's, over the same list
    table_row: BlockRow = field(default_factory=BlockRow)  # block_table as a tensor

    @classmethod
    def from_new(cls, new: NewSeq) -> HeldSeq:
        history = list(new.history) if uses_penalties(new.sampling) else None
        return cls(
            sampling=new.sampling,
            bias_token_ids=list(new.bias_token_ids),
            bias_values=list(new.bias_values),
            history=history,
            num_prompt_tokens=new.num_prompt_tokens,
            counts=PenaltyCounts(new.num_prompt_tokens, history) if history is not None else None,
        )

    def advance(self, work: SeqWork) -> None:
        """Take one step's work: its blocks, its position and its tokens."""
        if work.start_pos is None:
            start = self.position - work.rewind
            self.block_table.extend(work.block_ids)
        else:
            start = work.start_pos
            self.block_table[:] = work.block_ids
            self.table_row.reset()
        if self.history is not None:
            if start > len(self.history):
                raise ValueError(
                    f"seq {work.seq_id}: tokens from position {start} but its history holds "
                    f"{len(self.history)}"
                )
            if self.counts is not None:
                self.counts.unwind(start)
            del self.history[start:]
            self.history.extend(work.token_ids)
        self.step_start = start
        self.position = start + len(work.token_ids)


class SeqStates:
    def __init__(self) -> None:
        self.held: dict[int, HeldSeq] = {}

    def apply(self, plan: StepPlan) -> list[HeldSeq]:
        """Take a plan's news; the state of each of its works, in order. A work with start_pos
        naming a sequence not held starts one with no sampling settings (greedy)."""
        for seq_id in plan.dropped:
            self.held.pop(seq_id, None)
        for new in plan.new_seqs:
            self.held[new.seq_id] = HeldSeq.from_new(new)
        states = []
        for work in plan.seqs:
            held = self.held.get(work.seq_id)
            if held is None:
                if work.start_pos is None:
                    raise ValueError(
                        f"the step continues sequence {work.seq_id}, which this rank does not hold"
                    )
                held = self.held[work.seq_id] = HeldSeq()
            held.advance(work)
            states.append(held)
        return states
