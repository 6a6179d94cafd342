"""What a recipe decoder hands the fused decoder (ranks/fused_decoder.py): its shape and,
per layer, the tensors and linears the one native call reads. Models build it with
``decoder_weights()``; the fused decoder reads nothing else of the model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cpud.ranks.layers.linear import PackableLinear


@dataclass(frozen=True)
class DecoderLayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qkv: PackableLinear
    o: PackableLinear
    o_bias: torch.Tensor | None
    # A dense feed-forward: gate_up and down; an expert one: router and experts
    # (ranks/layers/moe.py's MoEExperts).
    gate_up: PackableLinear | None = None
    down: PackableLinear | None = None
    router: PackableLinear | None = None
    experts: Any = None
    cos_sin: torch.Tensor | None = None  # [max positions, rotary dim] fp32; None: no rotary
    window: int = 0  # sliding window (0: none)
    # sandwich norms (Gemma): on the attention output and on the feed-forward output
    attn_out_norm: torch.Tensor | None = None
    ffn_out_norm: torch.Tensor | None = None


@dataclass(frozen=True)
class DecoderWeights:
    layers: tuple[DecoderLayerWeights, ...]
    heads: int  # per rank
    kv_heads: int  # per rank
    head_dim: int
    q_size: int
    kv_size: int
    intermediate: int  # per rank: the dense feed-forward's, else the experts'
    eps: float
    scale: float
    embed: Callable[[torch.Tensor], torch.Tensor]
    final_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_dim: int
    max_positions: int
    gelu: bool = False  # gated GELU-tanh, else gated SiLU
    residual_scale: float = 1.0
    experts_per_tok: int = 0
