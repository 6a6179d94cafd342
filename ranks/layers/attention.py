"""Paged attention over a block-structured KV cache.

KV cache per layer: key_cache, value_cache [num_blocks, kv_heads_local, block_size, head_dim].
Token t of the step is written at slot_mapping[t] = block * block_size + offset. The compute
lives in ranks/ops.py (native kernel or torch reference); the step metadata and the reference
helpers in ranks/paged_kv.py.

Attention sinks (gpt-oss): a learned logit per head joins each softmax's denominator with no
value row, p_j = exp(s_j - m) / (exp(sink - m) + sum_i exp(s_i - m)), m the largest of them all.
Ops that take `sinks` say so (`attention_sinks = True`); for the others the torch reference
here runs over the same cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cpud.ranks.layers.base import Layer
from cpud.ranks.ops import paged_attention_per_sequence
from cpud.ranks.paged_kv import AttentionMetadata

if TYPE_CHECKING:
    from cpud.ranks.ops import Ops


def sink_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """query [heads, q, hd], keys/values [kv_heads, ctx, hd], sinks [heads] fp32, mask [q, ctx]
    bool or None -> [heads, q, hd] in query's dtype; scores and softmax in fp32."""
    groups = query.shape[0] // keys.shape[0]
    keys = keys.repeat_interleave(groups, dim=0).float()
    values = values.repeat_interleave(groups, dim=0).float()
    scores = torch.matmul(query.float(), keys.transpose(1, 2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, values).to(query.dtype)


def paged_sink_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """ops.attention's contract with sinks, in torch: query [T, nh, hd], key/value [T, nkv, hd]
    -> [T, nh, hd]; writes the KV cache."""

    def attend(
        q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        return sink_attention(q, keys, values, sinks, scale, mask)

    return paged_attention_per_sequence(query, key, value, kv_cache, meta, sliding_window, attend)


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
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [T, heads*hd], key/value [T, kv_heads*hd] (views are fine), sinks [heads]
        fp32 or None -> [T, heads*hd]."""
        tokens = query.shape[0]
        args = (
            query.view(tokens, self.num_heads, self.head_dim),
            key.view(tokens, self.num_kv_heads, self.head_dim),
            value.view(tokens, self.num_kv_heads, self.head_dim),
            kv_cache,
            meta,
            self.scale,
            self.sliding_window,
        )
        if sinks is None:
            out = self.ops.attention(*args)
        elif getattr(self.ops, "attention_sinks", False):
            out = self.ops.attention(*args, sinks=sinks)
        else:
            out = paged_sink_attention(*args, sinks)
        return out.view(tokens, self.num_heads * self.head_dim)
