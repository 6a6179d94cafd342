"""The paged KV cache's step metadata, its element formats, and the torch reference helpers
over it.

KV cache per layer: key_cache, value_cache [num_blocks, kv_heads_local, block_size, row].
Token t of the step is written at slot_mapping[t] = block * block_size + offset. The cache
tensor's dtype names the row format (--kv-cache-dtype; native/drivers/kv_formats.h):
  float32 / bfloat16 / float16  row = head_dim values
  int8                          row = head_dim int8 values q, then 4 bytes: their float32 scale
                                d = amax / 127 (one per token and kv head); value = q * d
  float8_e5m2                   row = head_dim bytes, the top byte of an fp16 (no scale),
                                rounded to nearest even, saturated at +-57344
  float8_e4m3fn                 row = head_dim e4m3fn bytes of value / d (rounded to nearest
                                even, saturated at +-448), then d = amax / 448 as int8's
cpud's quantized caches hold each row rotated by a Walsh-Hadamard transform first (hadamard):
it spreads a head's few large channels over the row, so the scale and the fp8 mantissas lose
less (mean NLL of the default model, tests/test_kv_dtype.py). The native kernels write the same
bytes as quantize_kv and attend in the rotated basis (queries rotated in, outputs rotated back);
dequantize_kv rotates rows back into the model's. `rotated=False` gives plain rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

# --kv-cache-dtype values and the cache dtype each names ("auto": the model's dtype)
KV_CACHE_TORCH_DTYPES = {
    "bf16": torch.bfloat16,
    "int8": torch.int8,
    "fp8_e5m2": torch.float8_e5m2,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
}
INT8_SCALE_BYTES = 4
E5M2_MAX = 57344.0
E4M3_MAX = 448.0
# cache dtypes whose rows end in a float32 scale, and the largest value / scale each stores
SCALED = {torch.int8: 127.0, torch.float8_e4m3fn: E4M3_MAX}
QUANTIZED = (torch.int8, torch.float8_e5m2, torch.float8_e4m3fn)


def kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype for a --kv-cache-dtype value under model dtype `dtype`."""
    return dtype if kv_cache_dtype == "auto" else KV_CACHE_TORCH_DTYPES[kv_cache_dtype]


def kv_cache_shape(
    num_blocks: int, kv_heads: int, block_size: int, head_dim: int, cache_dtype: torch.dtype
) -> tuple[int, int, int, int]:
    """Shape of one key or value cache tensor of cache_dtype."""
    row = head_dim + (INT8_SCALE_BYTES if cache_dtype in SCALED else 0)
    return (num_blocks, kv_heads, block_size, row)


def hadamard(x: torch.Tensor, query: bool) -> torch.Tensor:
    """x [..., hd] -> H x * 2^-s in float32 (native/drivers/kv_formats.h kv_hadamard, bit for
    bit): H the +-1 Walsh-Hadamard matrix on blocks of b = 2^m values, the largest power of two
    dividing hd; s = floor(m / 2) for a cached row, ceil(m / 2) for a query, an attention output
    or a row rotated back (the two scales multiply to 1 / b)."""
    head_dim = x.shape[-1]
    block = head_dim & -head_dim
    y, half = x.float(), 1
    while half < block:
        pairs = y.reshape(*x.shape[:-1], head_dim // (2 * half), 2, half)
        u, w = pairs[..., 0, :], pairs[..., 1, :]
        y, half = torch.stack((u + w, u - w), dim=-2).reshape(x.shape), 2 * half
    m = block.bit_length() - 1
    shift = (m + 1) // 2 if query else m // 2
    return y * 2.0**-shift if shift else y


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, rotated: bool = True) -> torch.Tensor:
    """Rows x [..., head_dim] as cache rows of cache_dtype (the module doc's formats; a
    quantized row rotated first unless rotated is False)."""
    if rotated and cache_dtype in QUANTIZED:
        x = hadamard(x, query=False)
    if cache_dtype == torch.int8:
        x32 = x.float()
        scale = x32.abs().amax(-1, keepdim=True) / 127
        inverse = torch.where(scale != 0, 1 / scale, torch.zeros_like(scale))
        q = torch.round(x32 * inverse).nan_to_num(0.0).clamp(-127, 127).to(torch.int8)
        return torch.cat((q, scale.contiguous().view(torch.int8)), dim=-1)
    if cache_dtype == torch.float8_e4m3fn:
        x32 = x.float()
        scale = x32.abs().amax(-1, keepdim=True) / E4M3_MAX
        ratio = torch.where(scale != 0, x32 / scale, torch.zeros_like(x32))
        q = ratio.nan_to_num(0.0).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        scale_bytes = scale.contiguous().view(torch.uint8).view(torch.float8_e4m3fn)
        return torch.cat((q, scale_bytes), dim=-1)
    if cache_dtype == torch.float8_e5m2:
        return x.float().clamp(-E5M2_MAX, E5M2_MAX).to(torch.float8_e5m2)
    return x.to(cache_dtype)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype, rotated: bool = True) -> torch.Tensor:
    """Cache rows [..., row] -> values [..., head_dim] in dtype: a quantized row's values as
    the kernels read them (float32), rotated back into the model's basis unless rotated is
    False."""
    if rows.dtype in SCALED:
        head_dim = rows.shape[-1] - INT8_SCALE_BYTES
        scale = rows[..., head_dim:].contiguous().view(torch.uint8).view(torch.float32)
        values = rows[..., :head_dim].float() * scale
    elif rows.dtype in QUANTIZED:
        values = rows.float()
    else:
        return rows.to(dtype)
    return (hadamard(values, query=True) if rotated else values).to(dtype)


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    query_starts: list[int]  # [S] first token of each sequence in the step
    query_lens: list[int]  # [S] tokens each sequence computes in this step
    seq_lens: list[int]  # [S] context length after this step
    block_size: int
    query_start_loc: torch.Tensor  # [S+1] int32, for the native kernel
    seq_lens_tensor: torch.Tensor  # [S] int32
    block_tables_i32: torch.Tensor  # [S, max_blocks] int32

    @cached_property
    def block_tables(self) -> torch.Tensor:
        """[S, max_blocks] int64, made when a reader asks (the per-op path)."""
        return self.block_tables_i32.long()


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value: [T, kv_heads, head_dim] scattered into the caches at slot_mapping, stored in
    the caches' format."""
    block_size = key_cache.shape[2]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    key_cache[blocks, :, offsets] = quantize_kv(key, key_cache.dtype)
    value_cache[blocks, :, offsets] = quantize_kv(value, value_cache.dtype)


def gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, length: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The first `length` cached positions of one sequence as [kv_heads, length, head_dim],
    read as `dtype` (default: the cache's own; float32 for a quantized cache)."""
    _, kv_heads, block_size, row = cache.shape
    num_blocks = -(-length // block_size)
    blocks = cache[block_table[:num_blocks]]  # [nb, kv_heads, bs, row]
    rows = blocks.transpose(0, 1).reshape(kv_heads, num_blocks * block_size, row)[:, :length]
    if dtype is None and cache.dtype in QUANTIZED:
        dtype = torch.float32
    if dtype is None or dtype == cache.dtype:
        return rows
    return dequantize_kv(rows, dtype)


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
