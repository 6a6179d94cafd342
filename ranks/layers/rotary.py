"""Rotary position embedding (neox style) with the scaling variants real checkpoints use."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from cpud.ranks.layers.base import Layer
from cpud.settings.errors import ConfigError

if TYPE_CHECKING:
    from cpud.ranks.ops import Ops


def _default_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    rotary_dim: int, base: float, scaling: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    factor = float(scaling["factor"])
    original = int(scaling.get("original_max_position_embeddings") or max_position)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(factor, scaling["mscale"]) / mscale(
                factor, scaling["mscale_all_dim"]
            )
        else:
            attention_factor = mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (rotary_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def rope_inv_freq(
    rotary_dim: int, base: float, scaling: dict[str, Any] | None, max_position: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling for a rope_scaling dict."""
    kind = (scaling or {}).get("rope_type", "default")
    inv_freq = _default_inv_freq(rotary_dim, base)
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if kind == "factors":  # per-frequency divisors, as GGUF files store llama3 scaling
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(rotary_dim, base, scaling, max_position)
    if kind == "longrope":
        raise ConfigError("longrope scaling has two sets of frequencies: use cos_sin_table")
    raise ConfigError(
        f"rope_scaling type {kind!r} is not supported (default, linear, llama3, yarn, factors, "
        f"longrope)"
    )


def longrope_inv_freqs(
    rotary_dim: int, base: float, scaling: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    """LongRoPE (Phi-3): (short, long) inverse frequencies, the original length from which the
    long ones apply, and the attention scaling. `scaling` holds short_factor, long_factor,
    original_max_position_embeddings and factor (max_position_embeddings / original, filled in
    from the config when absent: cpud.model.model_config.rope_scaling), optionally
    attention_factor; transformers' _compute_longrope_parameters, same rounding."""
    original = int(scaling["original_max_position_embeddings"])
    factor = float(scaling["factor"])
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    powers = base**exponents
    short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * powers)
    long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * powers)
    return short, long, original, float(attention)


def _longrope_freqs(
    rotary_dim: int, max_positions: int, base: float, scaling: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """[max_positions, rotary_dim / 2] angles: positions below the original length turn by the
    short factors, positions at or past it by the long ones. transformers picks one set per
    forward call (the long set for every token once any position reaches the original length;
    Phi-3's generate even recomputes the whole cache with it at that point), and llama.cpp one
    set per context size. Here a position's rotation depends on the position alone, so a KV
    entry written once stays right however the sequence grows, across chunked prefill, the
    prefix cache and batching: what transformers computes token by token with a cache (each
    step's own position picks the set), which tests/test_family_phi3.py states."""
    short, long, original, attention = longrope_inv_freqs(rotary_dim, base, scaling)
    positions = torch.arange(max_positions, dtype=torch.float32)
    inv_freq = torch.where((positions < original)[:, None], short[None, :], long[None, :])
    return positions[:, None] * inv_freq, attention


def cos_sin_table(
    rotary_dim: int, max_positions: int, base: float, scaling: dict[str, Any] | None = None
) -> torch.Tensor:
    """[max_positions, rotary_dim] fp32: cos | sin halves, attention scaling folded in."""
    if (scaling or {}).get("rope_type") == "longrope":
        freqs, attention_scaling = _longrope_freqs(rotary_dim, max_positions, base, scaling)
    else:
        inv_freq, attention_scaling = rope_inv_freq(rotary_dim, base, scaling, max_positions)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return (torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_scaling).contiguous()


class RotaryEmbedding(Layer):
    """A [max_positions, rotary_dim] fp32 table, cos | sin halves (attention scaling folded
    in), applied neox style by the ops."""

    def __init__(
        self,
        rotary_dim: int,
        max_positions: int,
        base: float,
        scaling: dict[str, Any] | None,
        ops: Ops,
    ):
        super().__init__()
        self.ops = ops
        table = cos_sin_table(rotary_dim, max_positions, base, scaling)
        self.register_buffer("cos_sin", table, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, head_dim], k: [T, kv_heads, head_dim], positions: [T]; may rotate
        in place."""
        return self.ops.rotary(positions, q, k, self.cos_sin)
