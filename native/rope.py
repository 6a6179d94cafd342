"""cos/sin cache for the rotary kernel: [max_pos, rot_dim] fp32, cos | sin halves.

Frequencies follow Hugging Face's rope init functions ("default", "linear",
"llama3"), so cached values equal HF's fp32 cos/sin for the same config.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch


def rope_inv_freq(
    rot_dim: int, base: float, scaling: Mapping[str, Any] | None = None
) -> torch.Tensor:
    """[rot_dim / 2] fp32 inverse frequencies, with rope_scaling applied."""
    if rot_dim < 2 or rot_dim % 2:
        raise ValueError(f"rot_dim must be even and >= 2, got {rot_dim}")
    exponent = torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim
    inv_freq = 1.0 / (base**exponent)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    assert scaling is not None
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3(inv_freq, scaling)
    raise ValueError(f"rope scaling {kind!r} is not supported (default, linear, llama3)")


def _llama3(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin_cache(
    rot_dim: int,
    max_pos: int,
    base: float = 10000.0,
    scaling: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """[max_pos, rot_dim] fp32: cos(p * f) | sin(p * f) for the rot_dim / 2 frequencies f."""
    inv_freq = rope_inv_freq(rot_dim, base, scaling)
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).contiguous()
