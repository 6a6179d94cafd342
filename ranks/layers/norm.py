"""RMSNorm (with the fused residual add) and LayerNorm."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from cpud.ranks.layers.base import Layer
from cpud.ranks.layers.linear import load_whole, new_param

if TYPE_CHECKING:
    from cpud.ranks.ops import Ops


def load_with_offset(offset: float) -> Any:
    """A loader of a norm weight stored as w that keeps offset + w (Gemma's 1 + weight)."""

    def load(param: nn.Parameter, source: Any, shard_id: Any = None) -> None:
        load_whole(param, source, shard_id)
        param.data += offset

    return load


class RMSNorm(Layer):
    """RMSNorm with the weight in the activations' dtype (Llama rounding), or in fp32 with an
    offset added at load (`fp32_weight`: Gemma's x * (1 + w) rounded once)."""

    def __init__(
        self,
        dim: int,
        eps: float,
        dtype: torch.dtype,
        ops: Ops,
        fp32_weight: bool = False,
        offset: float = 0.0,
    ):
        super().__init__()
        self.eps = eps
        self.ops = ops
        loader = load_with_offset(offset) if offset else load_whole
        self.weight = new_param((dim,), torch.float32 if fp32_weight else dtype, loader)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm of x over its last dim ([T, H] or [T, heads, H]); x is left intact."""
        return self.ops.rms_norm(x, self.weight, self.eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, new residual); with residual given, adds it to x first. Both
        inputs may be overwritten."""
        if residual is None:
            return self.normalize(x), x
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class LayerNorm(Layer):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = new_param((dim,), dtype, load_whole)
        self.bias = new_param((dim,), dtype, load_whole)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
