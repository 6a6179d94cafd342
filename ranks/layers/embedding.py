"""Vocab-parallel embedding and LM head: each rank owns a contiguous slice of the vocabulary."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cpud.ranks.layers.linear import copy_checked, new_param
from cpud.ranks.parallel import TPGroup

VOCAB_PADDING = 64


def vocab_shard_size(vocab_size: int, tp: int) -> int:
    padded = -(-vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    return -(-padded // tp)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype, group: TPGroup):
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        self.shard = vocab_shard_size(vocab_size, group.size)
        self.start = group.rank * self.shard
        self.rows = max(0, min(self.shard, vocab_size - self.start))
        self.weight = new_param((self.shard, dim), dtype, self.load_rows)

    def load_rows(self, param: nn.Parameter, source: Any, shard_id: Any = None) -> None:
        param.data[self.rows :].zero_()
        if self.rows:
            copy_checked(
                param.data[: self.rows], source[self.start : self.start + self.rows], "vocab rows"
            )

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(token_ids, self.weight)
        local = token_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(out)


class ParallelLMHead(nn.Module):
    """Logits for this rank's vocab slice, gathered to rank 0 and trimmed to vocab_size."""

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        dtype: torch.dtype,
        group: TPGroup,
        tied_to: VocabParallelEmbedding | None = None,
    ):
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = VocabParallelEmbedding(vocab_size, dim, dtype, group).weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.group.gather_last_dim(F.linear(hidden, self.weight))
        return None if logits is None else logits[..., : self.vocab_size]
