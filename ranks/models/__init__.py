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


def packable_layers(model: nn.Module) -> list[PackableLinear]:
    return [m for m in model.modules() if isinstance(m, PackableLinear) and m.weight is not None]


def begin_native_pack(model: nn.Module, ops: Ops) -> None:
    """Before loading (bf16 models on the native kernels): every matmul weight is packed for
    the native skinny GEMM as it loads; a tied embedding then reads its rows from the LM
    head's packed copy."""
    for layer in packable_layers(model):
        layer.begin_pack(ops.k)


def finish_native_pack(model: nn.Module) -> None:
    for layer in packable_layers(model):
        layer.finish_pack(with_bias=True)
