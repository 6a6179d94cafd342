"""Per-sequence token counts for repetition, presence and frequency penalties, kept on the rank
between steps: the counts follow the sequence's history list (held by the rank, changed in
place) and take in only the positions added since they were last applied, so a penalised step
costs its new tokens plus one vocabulary row, however long the sequence is. Only the rank that
samples applies them, so only it fills the tables.

Repetition penalises every token seen (prompt or output); presence and frequency read the
output tokens' counts. The tables grow with the largest token id seen (a vocabulary row at
most); ids past a table's end count zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cpud.protocol.step import SamplingSpec

GROW = 4096  # table sizes are multiples of this many ids


class PenaltyCounts:
    def __init__(self, num_prompt_tokens: int, history: list[int]) -> None:
        """history: the sequence's tokens so far, which the owner changes in place."""
        self.num_prompt_tokens = num_prompt_tokens
        self.history = history
        self.prompt_seen = torch.zeros(0, dtype=torch.bool)  # [ids] in the prompt
        self.output_counts = torch.zeros(0, dtype=torch.int32)  # [ids] times in the output
        self.counted = 0  # history positions folded in
        self.num_output = 0

    @classmethod
    def of(cls, prompt: Sequence[int], output: Sequence[int]) -> PenaltyCounts:
        """The counts of a prompt and an output given whole."""
        counts = cls(len(prompt), [*prompt, *output])
        counts.sync()
        return counts

    def sync(self) -> None:
        """Fold in the history's positions not yet counted."""
        history = self.history
        if self.counted > len(history):
            raise ValueError(
                f"{self.counted} positions counted but the history holds {len(history)}"
            )
        if self.counted == len(history):
            return
        split = max(self.counted, min(self.num_prompt_tokens, len(history)))
        self._see_prompt(history[self.counted : split])
        self._add_output(history[split:], 1)
        self.counted = len(history)

    def unwind(self, start: int) -> None:
        """The history's positions from `start` on are about to be dropped (a rewind past
        rejected proposals, a restart): stop counting them."""
        if start >= self.counted:
            return
        if start < self.num_prompt_tokens:  # prompt positions go: count again from scratch
            self.prompt_seen.zero_()
            self.output_counts.zero_()
            self.counted = self.num_output = 0
            return
        self._add_output(self.history[start : self.counted], -1)
        self.counted = start

    def apply(
        self, logits: torch.Tensor, spec: SamplingSpec, uncounted: Sequence[int] = ()
    ) -> None:
        """Penalise one row of logits [V] in place, as if the output's `uncounted` tokens (the
        last ones counted: proposals after the row's position) were not there."""
        self.sync()
        width = min(logits.shape[0], self.output_counts.shape[0])
        counts = self.output_counts[:width]
        num_output = self.num_output - len(uncounted)
        if uncounted:
            counts = counts.clone()
            ids = _ids(uncounted)
            ids = ids[ids < width]
            counts.index_add_(0, ids, torch.full_like(ids, -1, dtype=torch.int32))
        values = logits[:width]
        if spec.repetition_penalty != 1.0:
            seen = self.prompt_seen[:width] | (counts > 0)
            penalty = spec.repetition_penalty
            scaled = torch.where(values > 0, values / penalty, values * penalty)
            values.copy_(torch.where(seen, scaled, values))
        if (spec.presence_penalty or spec.frequency_penalty) and num_output > 0:
            amounts = counts.to(logits.dtype)
            values -= spec.frequency_penalty * amounts
            values -= spec.presence_penalty * (amounts > 0).to(logits.dtype)

    def _see_prompt(self, tokens: Sequence[int]) -> None:
        if tokens:
            ids = _ids(tokens)
            self._fit(ids)
            self.prompt_seen[ids] = True

    def _add_output(self, tokens: Sequence[int], sign: int) -> None:
        if not tokens:
            return
        ids = _ids(tokens)
        self._fit(ids)
        self.output_counts.index_add_(0, ids, torch.full_like(ids, sign, dtype=torch.int32))
        self.num_output += sign * len(tokens)

    def _fit(self, ids: torch.Tensor) -> None:
        """Grow the tables to hold every id in `ids`."""
        if not ids.numel():
            return
        needed = int(ids.max()) + 1
        size = self.output_counts.shape[0]
        if needed <= size:
            return
        size = -(-needed // GROW) * GROW
        grown = torch.zeros(size, dtype=torch.int32)
        grown[: self.output_counts.shape[0]] = self.output_counts
        self.output_counts = grown
        seen = torch.zeros(size, dtype=torch.bool)
        seen[: self.prompt_seen.shape[0]] = self.prompt_seen
        self.prompt_seen = seen


def _ids(tokens: Sequence[int]) -> torch.Tensor:
    """Token ids as a long tensor; negative ids (none should come) are left out."""
    ids = torch.tensor(list(tokens), dtype=torch.long)
    return ids[ids >= 0]
