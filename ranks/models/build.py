"""Build a rank's model for its family, and the native packing of its linears."""

from __future__ import annotations

import torch
from torch import nn

from cpud.model.model_config import ModelConfig
from cpud.ranks.layers.linear import PackableLinear
from cpud.ranks.layers.moe import MoEExperts
from cpud.ranks.models import registry
from cpud.ranks.models.decoder import DecoderForCausalLM
from cpud.ranks.models.encoder import EncoderForEmbedding
from cpud.ranks.models.moe import MoeForCausalLM
from cpud.ranks.models.opt import OPTForCausalLM
from cpud.ranks.ops import Ops, TorchOps
from cpud.ranks.parallel import TPGroup

MODEL_CLASSES = {
    "decoder": DecoderForCausalLM,
    "moe": MoeForCausalLM,
    "opt": OPTForCausalLM,
    "encoder": EncoderForEmbedding,
}


def build_model(
    cfg: ModelConfig,
    max_positions: int,
    dtype: torch.dtype,
    group: TPGroup,
    ops: Ops | None = None,
) -> nn.Module:
    """An unloaded model (torch.empty parameters) for this rank's shard."""
    return MODEL_CLASSES[registry.by_name(cfg.family).model](
        cfg, max_positions, dtype, group, ops or TorchOps()
    )


def packable_layers(model: nn.Module) -> dict[str, PackableLinear]:
    """Layers whose weight is not packed yet and is not kept quantized, by module name."""
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, PackableLinear) and m.weight is not None and m.quant_plan is None
    }


def packed_weight_names(model: nn.Module) -> frozenset[str]:
    """Parameter names (as the loader targets them) of the weights that get packed."""
    ids = {id(layer.weight) for layer in packable_layers(model).values()}
    return frozenset(name for name, p in model.named_parameters() if id(p) in ids)


def packed_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Shape of each packable layer's packed data, by module name."""
    from cpud.native import packed_shape

    return {
        name: packed_shape(*layer.weight.shape) for name, layer in packable_layers(model).items()
    }


def begin_native_pack(
    model: nn.Module, ops: Ops, packed: dict[str, torch.Tensor] | None = None
) -> None:
    """Before loading (bf16 models on the native kernels): every matmul weight is packed for
    the native skinny GEMM as it loads, or taken whole from `packed` (by module name, from
    the weight cache); a tied embedding then reads its rows from the LM head's packed copy."""
    for name, layer in packable_layers(model).items():
        layer.begin_pack(ops.k, None if packed is None else packed[name])
    for module in model.modules():
        if isinstance(module, MoEExperts):
            module.begin_pack()


def finish_native_pack(model: nn.Module) -> None:
    for layer in packable_layers(model).values():
        layer.finish_pack(with_bias=True)
    for module in model.modules():
        if isinstance(module, MoEExperts) and module.packed is None:
            module.finish_pack()
