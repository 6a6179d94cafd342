"""GGUF expert stacks (blk.N.ffn_{gate,up,down}_exps: [experts, rows, columns] in the file's
block format): kept in their blocks where the int8 kernels run the type, else one expert's rows
dense in the model's dtype.

Kept in blocks, each rank packs its shard of every expert once (``quant_stack``, in the layout
of dense quantized linears, straight from views of the mapped file) into one stacked buffer per
projection: gate/up take this rank's gate rows then its up rows, down takes its whole-block column
range of the intermediate dimension.  The
stacks go to the weight cache under the layer's name like other packed weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from cpud.native.quant_formats import KERNEL_FORMATS
from cpud.ranks.gguf_blocks import expert_blocks
from cpud.settings.errors import ConfigError

PARTS = ("gate", "up", "down")


@dataclass(frozen=True)
class ExpertsQuant:
    """The block types a layer's expert stacks stay in (gate and up share one), and this
    rank's shapes: gate_up [2 inter, hidden], down [hidden, inter] per expert."""

    gate_up: str
    down: str
    experts: int
    hidden: int
    inter: int

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Weight-cache entries (uint8) of the packed stacks, by suffix."""
        from cpud.native.moe_kernels import quant_stack_shapes

        gu = quant_stack_shapes(self.gate_up, self.experts, 2 * self.inter, self.hidden)
        dn = quant_stack_shapes(self.down, self.experts, self.hidden, self.inter)
        return {"gate_up.qs": gu[0], "gate_up.sc": gu[1], "down.qs": dn[0], "down.sc": dn[1]}

    @property
    def packed_bytes(self) -> int:
        return sum(int(np.prod(s)) for s in self.shapes().values())


def plan_experts(
    layer: Any, types: dict[str, str], tensor_names: dict[str, str]
) -> ExpertsQuant | None:
    """The layer's stacks kept in blocks when gate and up share a type and all three are
    kernel formats (else None: dequantized at load).  ConfigError naming --tp where this
    rank's range of down's columns is not whole blocks."""
    if set(types) != set(PARTS) or types["gate"] != types["up"]:
        return None
    if any(t not in KERNEL_FORMATS for t in types.values()):
        return None
    hidden, inter, tp = layer.hidden, layer.inter, layer.group.size
    for part, k in (("gate", hidden), ("down", inter)):
        block = KERNEL_FORMATS[types[part]].block_values
        if k % block == 0:
            continue
        if part == "down" and tp > 1 and (inter * tp) % block == 0:
            raise ConfigError(
                f"tensor {tensor_names['down']} ({types['down']}, blocks of {block} values): "
                f"--tp {tp} gives each rank {inter} of its {inter * tp} columns, not whole "
                f"blocks; use a --tp that splits {inter * tp} into multiples of {block}"
            )
        return None
    return ExpertsQuant(types["gate"], types["down"], layer.num_experts, hidden, inter)


def _gate_up_raw(layer: Any, e: int) -> tuple[np.ndarray, np.ndarray]:
    """Expert e's gate rows and up rows of this rank: views of the mapped file."""
    rows = layer.local_slice()
    gate = expert_blocks(layer.quant_sources["gate"], e, rows).data
    up = expert_blocks(layer.quant_sources["up"], e, rows).data
    return gate, up


def _down_raw(layer: Any, e: int) -> np.ndarray:
    """Expert e's down rows, this rank's column range: a view of the mapped file."""
    columns = layer.local_slice()
    return expert_blocks(layer.quant_sources["down"], e, slice(None), columns).data


def finish_experts(
    name: str, layer: Any, cached: dict[str, torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    """After loading: the layer's stacks packed from the blocks its loaders kept (or taken
    from `cached`); the dense parameters dropped.  Returns the weight-cache entries."""
    from cpud.native.moe_kernels import ExpertStack, quant_stack

    plan: ExpertsQuant = layer.quant_plan
    keys = {suffix: f"{name}.{suffix}" for suffix in plan.shapes()}
    if cached is not None:
        gate_up = ExpertStack(
            2 * plan.inter, plan.hidden, cached[keys["gate_up.qs"]], plan.gate_up,
            cached[keys["gate_up.sc"]],
        )  # fmt: skip
        down = ExpertStack(
            plan.hidden, plan.inter, cached[keys["down.qs"]], plan.down, cached[keys["down.sc"]]
        )
    else:
        missing = [p for p in PARTS if p not in layer.quant_sources]
        if missing:
            raise ConfigError(f"{name}: the file has no {', '.join(missing)} expert stack")
        gate_up = quant_stack(
            lambda e: _gate_up_raw(layer, e), plan.gate_up, 2 * plan.inter, plan.hidden,
            plan.experts,
        )  # fmt: skip
        down = quant_stack(
            lambda e: _down_raw(layer, e), plan.down, plan.hidden, plan.inter, plan.experts
        )
    layer.quant = (gate_up, down)
    layer.quant_sources = {}
    layer.gate_up_proj = None
    layer.down_proj = None
    return {
        keys["gate_up.qs"]: gate_up.data,
        keys["gate_up.sc"]: gate_up.scales,
        keys["down.qs"]: down.data,
        keys["down.sc"]: down.scales,
    }


def expert_layers(model: nn.Module) -> dict[str, Any]:
    """Every expert layer (ranks/layers/moe.py MoEExperts) by module name."""
    from cpud.ranks.layers.moe import MoEExperts

    return {name: m for name, m in model.named_modules() if isinstance(m, MoEExperts)}


def expert_bytes(model: nn.Module) -> int:
    """Bytes of the packed quantized expert stacks the model holds."""
    return sum(s.weight_bytes for m in expert_layers(model).values() if m.quant for s in m.quant)


def expert_plans(model: nn.Module, checked: Any) -> dict[str, ExpertsQuant]:
    """The expert layers of a model loading from a GGUF file (gguf_model.GGUFModel) whose
    stacks stay in their blocks, by module name."""
    from cpud.model.gguf_names import hf_name
    from cpud.ranks.checkpoint_targets import targets
    from cpud.ranks.layers.moe import ALL

    layers = expert_layers(model)
    owner = {f"{name}.{p}": name for name in layers for p in ("gate_up_proj", "down_proj")}
    types: dict[str, dict[str, str]] = {}
    names: dict[str, dict[str, str]] = {}
    for info in checked.tensors.values():
        hf = hf_name(info.name, model.cfg.family) if len(info.shape) == 3 else None
        for target, shard_id, _ in targets(model, hf) if hf else ():
            layer = owner.get(target)
            if layer is None or not isinstance(shard_id, tuple) or shard_id[0] != ALL:
                continue
            part = "down" if target.endswith("down_proj") else PARTS[shard_id[1]]
            types.setdefault(layer, {})[part] = info.type
            names.setdefault(layer, {})[part] = info.name
    plans = {}
    for name, found in types.items():
        plan = plan_experts(layers[name], found, names[name])
        if plan is not None:
            plans[name] = plan
    return plans


def hf_expert_plans(model: Any, model_dir: Path) -> dict[str, Any]:
    """The expert layers of a model loading from a Hugging Face directory whose MXFP4 expert
    stacks stay in their blocks (plan_experts), by module name."""
    from safetensors import safe_open

    from cpud.model.safetensors_check import weight_files
    from cpud.ranks.hf_mxfp4 import BLOCKS, pair_names

    layers = expert_layers(model)
    if not layers:
        return {}
    names: set[str] = set()
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    pairs = pair_names(names)
    plans = {}
    for name, layer in layers.items():
        stems = {part: f"{name}.{part}_proj{BLOCKS}" for part in ("gate_up", "down")}
        if not all(stem in pairs for stem in stems.values()):
            continue
        types = dict.fromkeys(("gate", "up", "down"), "MXFP4")
        tensors = {"gate": stems["gate_up"], "up": stems["gate_up"], "down": stems["down"]}
        plan = plan_experts(layer, types, tensors)
        if plan is not None:
            plans[name] = plan
    return plans
