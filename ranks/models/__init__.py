"""Model classes by family."""

from __future__ import annotations

import torch
from torch import nn

from cpud.ranks.layers.linear import PackableLinear
from cpud.ranks.model_config import ModelConfig
from cpud.ranks.models.llama import LlamaForCausalLM
from cpud.ranks.models.opt import OPTForCausalLM
from cpud.ranks.ops import Ops, TorchOps
from cpud.ranks.parallel import TPGroup

MODEL_CLASSES = {"llama": LlamaForCausalLM, "opt": OPTForCausalLM}


def build_model(
    cfg: ModelConfig,
    max_positions: int,
    dtype: torch.dtype,
    group: TPGroup,
    ops: Ops | None = None,
) -> nn.Module:
    """An unloaded model (torch.empty parameters) for this rank's shard."""
    return MODEL_CLASSES[cfg.family](cfg, max_positions, dtype, group, ops or TorchOps())


def pack_for_native(model: nn.Module, ops: Ops) -> None:
    """Repack every matmul weight for the native skinny GEMM (bf16 models only); a tied
    embedding then reads its rows from the LM head's packed copy."""
    kernels = ops.k
    for module in model.modules():
        if isinstance(module, PackableLinear) and module.weight is not None:
            module.pack(kernels, with_bias=True)
