"""Vocab-parallel embedding and LM head: each rank owns a contiguous slice of the vocabulary."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cpud.model.sizes import vocab_shard_size
from cpud.ranks.layers.base import Layer
from cpud.ranks.layers.linear import PackableLinear, check_shape, copy_checked, new_param
from cpud.ranks.parallel import TPGroup


class VocabParallelEmbedding(Layer):
    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype, group: TPGroup):
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        self.shard = vocab_shard_size(vocab_size, group.size)
        self.start = group.rank * self.shard
        self.rows = max(0, min(self.shard, vocab_size - self.start))
        self.dim = dim
        self.dtype = dtype
        self.row_blocks: Any = None  # this rank's rows in their GGUF blocks (quant_linear.py)
        self.weight = new_param((self.shard, dim), dtype, self.load_rows)
        self.packed: Any = None
        self.packing: torch.Tensor | None = None  # the LM head's packed storage, while loading

    def share_packed(self, packed: Any) -> None:
        """Look rows up in the LM head's packed copy of this (tied) table; drop our own."""
        self.packed = packed
        self.weight = None

    def block_region(self, shard_id: Any) -> tuple[int, slice, slice]:
        return 0, slice(self.start, self.start + self.rows), slice(None)

    def lookup(self, local_ids: torch.Tensor) -> torch.Tensor:
        if self.row_blocks is not None:
            from cpud.ranks.quant_compute import dequantize_rows

            return dequantize_rows(self.row_blocks, local_ids, self.dtype)
        if self.packed is None:
            return F.embedding(local_ids, self.weight)
        # packed.data: [N/32, K/2, 32, 2]; row n lives at [n // 32, :, n % 32, :]
        rows = self.packed.data[local_ids // 32, :, local_ids % 32, :]
        return rows.reshape(local_ids.shape[0], -1)[:, : self.dim]

    def load_rows(self, param: nn.Parameter, source: Any, shard_id: Any = None) -> None:
        loaded = source[self.start : self.start + self.rows] if self.rows else None
        if self.packing is not None:
            from cpud.native import pack_rows

            if loaded is not None:
                check_shape((self.rows, self.dim), loaded, "vocab rows")
                pack_rows(self.packing, 0, loaded)
            if self.rows < self.shard:
                pack_rows(self.packing, self.rows, torch.zeros(self.shard - self.rows, self.dim))
            return
        param.data[self.rows :].zero_()
        if loaded is not None:
            copy_checked(param.data[: self.rows], loaded, "vocab rows")

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return self.lookup(token_ids)
        local = token_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = self.lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(out)


class ParallelLMHead(PackableLinear):
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
        # A tuple, so the embedding is not registered twice as a submodule.
        self.tied_to: tuple[VocabParallelEmbedding, ...] = (tied_to,) if tied_to else ()
        # The table whose loader fills the weight: the tied embedding, or one of our own (a
        # tuple again: registered nowhere, its weight is ours).
        self.table = (tied_to or VocabParallelEmbedding(vocab_size, dim, dtype, group),)
        self.weight = self.table[0].weight

    bias = None

    def block_region(self, shard_id: Any) -> tuple[int, slice, slice]:
        return self.table[0].block_region(shard_id)

    def begin_pack(self, kernels: Any, packed: torch.Tensor | None = None) -> None:
        super().begin_pack(kernels, packed)
        self.table[0].packing = self._packing

    def finish_pack(self, with_bias: bool = False) -> None:
        super().finish_pack(with_bias=False)
        self.table[0].packing = None
        for embedding in self.tied_to:
            embedding.share_packed(self.packed)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.group.gather_last_dim(self.matmul(hidden, None))
        return None if logits is None else logits[..., : self.vocab_size]
