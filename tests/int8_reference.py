"""transformers with the int8 kernels' activation rounding: the reference for cpud's quantized
GEMM path (every linear's input rounded per row to int8 blocks of 32 values, scale amax / 127,
round half to even, as native/quant.py's quant_gemm does before its integer dot products)."""

from __future__ import annotations

import torch
from torch import nn

BLOCK = 32


def round_to_int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K a multiple of 32) after int8 rounding per 32 values, in x's dtype."""
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.round(blocks / torch.where(scale == 0, torch.ones_like(scale), scale))
    return (q * scale).reshape(x.shape).to(x.dtype)


def with_int8_activations(model: nn.Module) -> nn.Module:
    """Hooks on every nn.Linear of `model` (in place) that round its input as the kernels do."""
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.in_features % BLOCK == 0:
            module.register_forward_pre_hook(lambda _, args: (round_to_int8_blocks(args[0]),))
    return model
