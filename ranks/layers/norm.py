"""RMSNorm with the optional fused residual add, matching Hugging Face's numerics."""

from __future__ import annotations

import torch
from torch import nn

from cpud.ranks.layers.linear import load_whole, new_param


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = new_param((dim,), dtype, load_whole)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, new residual); with residual given, adds it to x first."""
        if residual is not None:
            x = x + residual
        return self.normalize(x), x


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = new_param((dim,), dtype, load_whole)
        self.bias = new_param((dim,), dtype, load_whole)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
