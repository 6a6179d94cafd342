"""The compute behind the layers: native SIMD kernels (default where built) or the torch
reference. Chosen once per runner and passed to every layer; nothing switches at run time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from cpud.ranks.paged_kv import AttentionMetadata, causal_mask, gather_context, write_kv
from cpud.settings.config import KERNEL_KINDS as KINDS
from cpud.settings.errors import ConfigError


class Ops(Protocol):
    name: str

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim of [T, H] or [T, heads, H]; may reuse x's storage.
        weight in x's dtype: HF LlamaRMSNorm; float32 on a lower-precision x: Gemma's form
        (x * inv * weight in fp32, rounded once; weight holds Gemma's 1 + w)."""
        ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual), x + residual); may reuse both inputs' storage."""
        ...

    def rotary(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos_sin: torch.Tensor,
        neox: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotation of q [T, nh, hd] and k [T, nkv, hd] (neox: halves, else gpt-j pairs);
        cos_sin [P, rot] fp32."""
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """gelu(gate, approximate="tanh") * up for x [T, 2I] = gate | up, in x's dtype."""
        ...

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """int64 [S]: index of the first largest logit of each row of [S, vocab]."""
        ...

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """query [T, nh, hd], key/value [T, nkv, hd] -> [T, nh, hd]; writes the KV cache."""
        ...


class TorchOps:
    """Reference implementation: plain torch, the numerics of Hugging Face's modules."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        if weight.dtype == torch.float32 and x.dtype != torch.float32:
            return (x32 * weight).to(x.dtype)  # Gemma3RMSNorm
        return weight * x32.to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x + residual
        return self.rms_norm(summed, weight, eps), summed

    def rotary(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos_sin: torch.Tensor,
        neox: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        half = cos_sin.shape[-1] // 2
        table = cos_sin[positions].unsqueeze(1)
        cos, sin = table[..., :half], table[..., half:]
        if neox:
            cos = torch.cat((cos, cos), dim=-1).to(q.dtype)
            sin = torch.cat((sin, sin), dim=-1).to(q.dtype)
        else:
            cos = cos.repeat_interleave(2, dim=-1).to(q.dtype)
            sin = sin.repeat_interleave(2, dim=-1).to(q.dtype)
        return _rotate(q, cos, sin, neox), _rotate(k, cos, sin, neox)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    @staticmethod
    def argmax(logits: torch.Tensor) -> torch.Tensor:
        # max() is vectorized for bf16 where argmax() is not, and picks the same (first) index
        return logits.max(dim=-1).indices

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        def attend(
            q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
        ) -> torch.Tensor:
            return F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
            )

        return paged_attention_per_sequence(
            query, key, value, kv_cache, meta, sliding_window, attend, query.dtype
        )


# (q [nh, q_len, hd], keys [nkv, ctx, hd], values, mask [q_len, ctx] or None) -> [nh, q_len, hd]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def paged_attention_per_sequence(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    sliding_window: int | None,
    attend: Attend,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """ops.attention's contract in torch, one sequence at a time: writes key/value into the
    caches, then attend(q [nh, q_len, hd], keys, values [nkv, ctx, hd] read as dtype
    (gather_context), causal mask [q_len, ctx] or None) -> [nh, q_len, hd] per sequence."""
    key_cache, value_cache = kv_cache
    write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
    out = torch.empty_like(query)
    for seq, (start, qlen, ctx) in enumerate(
        zip(meta.query_starts, meta.query_lens, meta.seq_lens)
    ):
        table = meta.block_tables[seq]
        keys = gather_context(key_cache, table, ctx, dtype)
        values = gather_context(value_cache, table, ctx, dtype)
        q = query[start : start + qlen].transpose(0, 1)
        attn = attend(q, keys, values, causal_mask(qlen, ctx, sliding_window))
        out[start : start + qlen] = attn.transpose(0, 1)
    return out


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """x * cos + rotate(x) * sin on the first rot_dim dims: rotate_half (neox) or
    rotate_every_two (gpt-j pairs)."""
    rot_dim = cos.shape[-1]
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    if neox:
        half = rot_dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    else:
        rotated = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
    out = rot * cos + rotated * sin
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


class NativeOps:
    """cpud.native kernels (SIMD, OpenMP on torch's libgomp)."""

    name = "native"
    attention_sinks = True  # attention() takes sinks (ranks/layers/attention.py)

    def __init__(self, kernels: object):
        self.k = kernels

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.k.rms_norm(x, weight, eps, out=torch.empty_like(x))

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.k.fused_add_rms_norm(x, residual, weight, eps)
        return x, residual

    def rotary(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos_sin: torch.Tensor,
        neox: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.k.rotary_embedding(positions, q, k, cos_sin, is_neox=neox)
        return q, k

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.k.silu_and_mul(x)

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.k.gelu_tanh_and_mul(x)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        # torch's max over 32 x 151936 bf16 logits takes ~4 ms on 2 cores, the kernel ~0.3
        if logits.dtype not in (torch.bfloat16, torch.float32):
            return TorchOps.argmax(logits)
        return self.k.argmax(logits)

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        self.k.write_kv_cache(key, value, key_cache, value_cache, meta.slot_mapping)
        return self.k.paged_attention(
            query,
            key_cache,
            value_cache,
            meta.query_start_loc,
            meta.seq_lens_tensor,
            meta.block_tables_i32,
            scale,
            sliding_window or 0,
            sinks=sinks,
        )


def make_ops(kind: str) -> Ops:
    """'auto': native where the library is built, else torch; 'native' insists."""
    if kind not in KINDS:
        raise ConfigError(f"kernels {kind!r} is not one of {', '.join(KINDS)}")
    if kind == "torch":
        return TorchOps()
    from cpud import native

    if native.available():
        return NativeOps(native.kernels())
    if kind == "native":
        raise ConfigError(
            f"native kernels are not built ({native.load_error()}): reinstall with a C "
            f"compiler (gcc >= 10) or use --kernels torch"
        )
    return TorchOps()
