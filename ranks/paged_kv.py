"""The paged KV cache's step metadata and the torch reference helpers over it.

KV cache per layer: key_cache, value_cache [num_blocks, kv_heads_local, block_size, head_dim].
Token t of the step is written at slot_mapping[t] = block * block_size + offset.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [S, max_blocks] int64
    query_starts: list[int]  # [S] first token of each sequence in the step
    query_lens: list[int]  # [S] tokens each sequence computes in this step
    seq_lens: list[int]  # [S] context length after this step
    block_size: int
    query_start_loc: torch.Tensor  # [S+1] int32, for the native kernel
    seq_lens_tensor: torch.Tensor  # [S] int32
    block_tables_i32: torch.Tensor  # [S, max_blocks] int32


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value: [T, kv_heads, head_dim] scattered into the caches at slot_mapping."""
    block_size = key_cache.shape[2]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    key_cache[blocks, :, offsets] = key
    value_cache[blocks, :, offsets] = value


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached positions of one sequence as [kv_heads, length, head_dim]."""
    _, kv_heads, block_size, head_dim = cache.shape
    num_blocks = -(-length // block_size)
    blocks = cache[block_table[:num_blocks]]  # [nb, kv_heads, bs, hd]
    return blocks.transpose(0, 1).reshape(kv_heads, num_blocks * block_size, head_dim)[:, :length]


def causal_mask(
    query_len: int, context_len: int, sliding_window: int | None
) -> torch.Tensor | None:
    """Boolean [query_len, context_len] mask; None when every query sees every key."""
    if query_len == 1 and (sliding_window is None or context_len <= sliding_window):
        return None
    q_pos = torch.arange(context_len - query_len, context_len).unsqueeze(1)
    k_pos = torch.arange(context_len).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask
