"""Paged attention over a block-structured KV cache.

KV cache per layer: key_cache, value_cache [num_blocks, kv_heads_local, block_size, head_dim].
Token t of the step is written at slot_mapping[t] = block * block_size + offset. The compute
lives in ranks/ops.py (native kernel or torch reference); the step metadata and the reference
helpers in ranks/paged_kv.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cpud.ranks.layers.base import Layer
from cpud.ranks.paged_kv import AttentionMetadata

if TYPE_CHECKING:
    from cpud.ranks.ops import Ops


class PagedAttention(Layer):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        ops: Ops,
        sliding_window: int | None = None,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.ops = ops
        self.sliding_window = sliding_window

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """query [T, heads*hd], key/value [T, kv_heads*hd] (views are fine) -> [T, heads*hd]."""
        tokens = query.shape[0]
        out = self.ops.attention(
            query.view(tokens, self.num_heads, self.head_dim),
            key.view(tokens, self.num_kv_heads, self.head_dim),
            value.view(tokens, self.num_kv_heads, self.head_dim),
            kv_cache,
            meta,
            self.scale,
            self.sliding_window,
        )
        return out.view(tokens, self.num_heads * self.head_dim)
