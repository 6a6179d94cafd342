"""Model classes by family."""

from __future__ import annotations

import torch
from torch import nn

from cpud.ranks.model_config import ModelConfig
from cpud.ranks.models.llama import LlamaForCausalLM
from cpud.ranks.models.opt import OPTForCausalLM
from cpud.ranks.parallel import TPGroup

MODEL_CLASSES = {"llama": LlamaForCausalLM, "opt": OPTForCausalLM}


def build_model(
    cfg: ModelConfig, max_positions: int, dtype: torch.dtype, group: TPGroup
) -> nn.Module:
    """An unloaded model (torch.empty parameters) for this rank's shard."""
    return MODEL_CLASSES[cfg.family](cfg, max_positions, dtype, group)
