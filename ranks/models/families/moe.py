"""Mixture-of-experts decoders: Qwen2-MoE (shared expert), Qwen3-MoE and Mixtral. Attention
as the Llama recipe; the feed-forward of expert layers routes each token to its top-k experts
(ranks/models/moe.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cpud.model.model_config import (
    ConfigFields,
    ModelConfig,
    common_fields,
    decoder_config,
    decoder_fields,
    is_int,
)
from cpud.model.moe_recipe import MoeRecipe
from cpud.ranks.models.families.qwen import qwen_window
from cpud.ranks.models.family import Family

if TYPE_CHECKING:
    from cpud.model.gguf_meta import GGUFMeta

MIXTRAL = "MixtralForCausalLM"


def _hf_moe_fields(f: ConfigFields, arch: str, num_layers: int) -> dict[str, Any]:
    """Expert count, routing and which layers stay dense, checked against each other."""
    # transformers 5 writes num_local_experts for Qwen3-MoE too; published configs say num_experts
    experts = f.size("num_local_experts" if f.raw.get("num_experts") is None else "num_experts")
    top_k = f.size("num_experts_per_tok")
    if top_k > experts:
        raise f.error("num_experts_per_tok", f"at most the {experts} experts", top_k)
    if arch == MIXTRAL:
        return dict(
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=f.size("intermediate_size"),
            norm_topk_prob=True,
            moe=MoeRecipe(renormalize=True),
        )
    step = f.size("decoder_sparse_step", 1)
    only = f.value("mlp_only_layers", [])
    if not isinstance(only, list) or not all(is_int(i) and 0 <= i < num_layers for i in only):
        raise f.error("mlp_only_layers", f"a list of layer indices below {num_layers}", only)
    dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    shared = f.size("shared_expert_intermediate_size") if arch == "Qwen2MoeForCausalLM" else 0
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=f.size("moe_intermediate_size"),
        norm_topk_prob=f.flag("norm_topk_prob", False),
        router_weights_in_dtype=True,
        moe=MoeRecipe(renormalize=f.flag("norm_topk_prob", False), weights_in_dtype=True),
        dense_layers=dense,
        shared_expert_intermediate_size=shared,
    )


def hf_config(f: ConfigFields, architecture: str) -> ModelConfig:
    common = common_fields(f, architecture, "moe")
    fields = common | decoder_fields(f, common)
    if architecture != MIXTRAL:
        qwen_window(f, fields)
    if architecture == "Qwen2MoeForCausalLM":
        fields["qkv_bias"] = f.flag("qkv_bias", True) or fields["qkv_bias"]
    if architecture == "Qwen3MoeForCausalLM":
        fields["qk_norm"] = True
    fields |= _hf_moe_fields(f, architecture, common["num_layers"])
    return decoder_config(fields)


def gguf_has_experts(m: GGUFMeta) -> bool:
    return m.get("expert_count") is not None


def gguf_config(m: GGUFMeta) -> ModelConfig:
    """Experts from the metadata; a layer without blk.N.ffn_gate_inp keeps a dense MLP. Both
    kinds renormalise the top-k weights (llama.cpp does for qwen3moe and llama)."""
    from cpud.model.gguf_meta import decoder_fields as gguf_fields
    from cpud.model.gguf_meta import layers

    qwen = m.arch == "qwen3moe"
    fields = gguf_fields(m)
    fields |= dict(architecture="Qwen3MoeForCausalLM" if qwen else MIXTRAL, family="moe")
    fields["qk_norm"] = qwen
    experts, top_k = m.size("expert_count"), m.size("expert_used_count")
    if top_k > experts:
        raise m.error(f"{m.arch}.expert_used_count", f"at most expert_count {experts}", top_k)
    count = layers(m, m.tensors)
    dense = tuple(i for i in range(count) if f"blk.{i}.ffn_gate_inp.weight" not in m.tensors)
    fields |= dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=m.size(
            "expert_feed_forward_length" if qwen else "feed_forward_length"
        ),
        norm_topk_prob=True,
        router_weights_in_dtype=qwen,
        moe=MoeRecipe(renormalize=True, weights_in_dtype=qwen),
        dense_layers=dense,
    )
    return decoder_config(fields)


FAMILY = Family(
    name="moe",
    hf_architectures=("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", MIXTRAL),
    hf_config=hf_config,
    gguf_architectures=("qwen3moe",),
    gguf_config=gguf_config,
    model="moe",
    gguf_permuted_qk=("llama",),
)
