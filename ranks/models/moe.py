"""Mixture-of-experts decoders (Qwen3-MoE, Qwen2-MoE, Mixtral): the Llama-family decoder with
sparse expert blocks (ranks/layers/moe.py) in place of the dense MLP on the layers the config
names.

Checkpoints keep one tensor per expert and projection (Qwen3-MoE: mlp.experts.{e}.gate_proj /
up_proj / down_proj; Mixtral: block_sparse_moe.experts.{e}.w1 / w3 / w2); each loads into its
expert's slice of the stacked parameters.
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch

from cpud.ranks.gguf_stack_rows import gate_up_bias_halves, gate_up_halves
from cpud.ranks.layers.base import Layer
from cpud.ranks.layers.moe import ALL, SparseMoeBlock
from cpud.ranks.models.decoder import DecoderForCausalLM, DecoderLayer
from cpud.ranks.models.decoder_weights import DecoderLayerWeights, DecoderWeights
from cpud.ranks.ops import Ops
from cpud.ranks.parallel import TPGroup

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACK = re.compile(r"^(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj)\.weight$")  # GGUF
_FUSED_STACK = re.compile(r"^(.*\.mlp\.experts)\.gate_up_proj\.weight$")  # ffn_gate_up_exps
_FUSED_BIAS = re.compile(r"^(.*\.mlp\.experts)\.gate_up_proj\.bias$")  # its bias [E, 2 I]
_MIXTRAL = (
    (".block_sparse_moe.", ".mlp."),
    (".w1.", ".gate_proj."),
    (".w3.", ".up_proj."),
    (".w2.", ".down_proj."),
)
_PART = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class MoeForCausalLM(DecoderForCausalLM):
    def decoder_weights(self) -> DecoderWeights:
        table = super().decoder_weights()
        block = next(layer.mlp for layer in self.model.layers if hasattr(layer.mlp, "experts"))
        dense = self.cfg.dense_layers
        return replace(
            table,
            intermediate=table.intermediate if dense else block.experts.inter,
            experts_per_tok=block.top_k,
        )

    @staticmethod
    def layer_weights(layer: DecoderLayer) -> DecoderLayerWeights:
        table = DecoderForCausalLM.layer_weights(layer)
        if not isinstance(layer.mlp, SparseMoeBlock):
            return table
        return replace(table, router=layer.mlp.gate, experts=layer.mlp.experts)

    def mlp_for(self, index: int, dtype: torch.dtype, group: TPGroup, ops: Ops) -> Layer | None:
        return SparseMoeBlock(self.cfg, dtype, group, ops) if self.cfg.moe_layer(index) else None

    def fused_parts(self, name: str) -> list[tuple] | None:
        """A GGUF stack of every expert's gate and up rows (and its bias): its halves as the
        separate stacks (biases)."""
        inter = self.cfg.moe_intermediate_size
        fused = _FUSED_STACK.match(name)
        if fused is not None:
            return gate_up_halves(f"{fused.group(1)}.gate_up_proj", inter)
        fused = _FUSED_BIAS.match(name)
        if fused is not None:
            return gate_up_bias_halves(f"{fused.group(1)}.gate_up_proj_bias", inter)
        return super().fused_parts(name)

    def checkpoint_name(self, name: str) -> str:
        if ".block_sparse_moe." not in name:
            return name
        for old, new in _MIXTRAL:
            name = name.replace(old, new)
        return name

    def checkpoint_target(self, name: str) -> tuple[str, object] | None:
        """(stacked parameter, (expert, part)) for one expert's projection, (stacked parameter,
        (ALL, part)) for a stack of every expert's, else None."""
        stack = _STACK.match(name)
        if stack is not None:
            prefix, proj = stack.groups()
            param, part = _PART.get(proj, ("down_proj", 0))
            return f"{prefix}.{param}", (ALL, part)
        match = _EXPERT.match(name)
        if match is None:
            return None
        prefix, expert, proj = match.groups()
        expert = int(expert)
        if expert >= self.cfg.num_experts:
            return f"{name} (expert {expert} of {self.cfg.num_experts})", None
        param, part = _PART.get(proj, ("down_proj", 0))
        return f"{prefix}.{param}", (expert, part)

    def loaded_shards(self, loaded: set[tuple[str, object]]) -> set[tuple[str, object]]:
        """`loaded` with each stack of every expert counted as each expert's part, and a
        whole stack in cpud's layout (shard None: gpt-oss's views) as all of them."""
        experts = range(self.cfg.num_experts)
        out = set(loaded)
        for name, shard in loaded:
            if isinstance(shard, tuple) and shard[0] == ALL:
                out.update((name, (e, shard[1])) for e in experts)
            elif shard is None and name.endswith(".experts.gate_up_proj"):
                out.update((name, (e, part)) for e in experts for part in (0, 1))
            elif shard is None and name.endswith(".experts.down_proj"):
                out.update((name, (e, 0)) for e in experts)
        # a bias loaded in halves (GGUF) is whole once both are
        halves = {name for name, shard in loaded if shard == (ALL, 0)}
        out.update((name, None) for name, shard in loaded if shard == (ALL, 1) and name in halves)
        return out

    def param_shards(self, name: str) -> list[object] | None:
        """The (expert, part) pieces a stacked expert parameter loads from, else None."""
        experts = range(self.cfg.num_experts)
        if name.endswith(".experts.gate_up_proj"):
            return [(e, part) for e in experts for part in (0, 1)]
        if name.endswith(".experts.down_proj"):
            return [(e, 0) for e in experts]
        return None
