"""gpt-oss (GptOssForCausalLM, GGUF `gpt-oss`): a mixture-of-experts decoder with attention
sinks (a learned logit per head in each softmax's denominator), sliding-window attention on
every other layer (the first of each pair), biases on q/k/v/o, YaRN RoPE (not truncated),
RMSNorm with fp32 weights, and experts with biases and the clamped SwiGLU
((clamp(up) + 1) * g * sigmoid(alpha g), g = min(gate, limit)) routed by a softmax over the top
k router logits (the router has a bias).

Hugging Face checkpoints stack each layer's experts transposed and with gate and up columns
interleaved (gate_up_proj [E, H, 2I]: gate = [..., ::2], up = [..., 1::2]; down_proj
[E, I, H]); they are read per expert through views in cpud's layout
(ranks/models/expert_views.py). The router is mlp.router there, mlp.gate here."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from cpud.model.model_config import (
    ConfigFields,
    ModelConfig,
    common_fields,
    decoder_fields,
    standard_recipe,
)
from cpud.model.moe_recipe import MoeRecipe
from cpud.model.recipe import LayerRecipe
from cpud.ranks.models.expert_views import expert_views, gguf_bias_views, renamed
from cpud.ranks.models.family import Family

if TYPE_CHECKING:
    from cpud.model.gguf_meta import GGUFMeta

ARCHITECTURE = "GptOssForCausalLM"
SLIDING, FULL = "sliding_attention", "full_attention"
# GptOssConfig's defaults
ROPE_THETA = 150000.0
YARN = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
WINDOW = 128
HEAD_DIM = 64
RMS_EPS = 1e-5


def _layer_kinds(f: ConfigFields, layers: int) -> list[str]:
    """layer_types, else transformers' default: sliding on even layers, full on odd ones."""
    kinds = f.value("layer_types", None)
    if kinds is None:
        return [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]
    known = isinstance(kinds, list) and all(k in (SLIDING, FULL) for k in kinds)
    if not known or len(kinds) != layers:
        raise f.error("layer_types", f"a list of {layers} {SLIDING!r} or {FULL!r}", kinds)
    return kinds


def _with_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json as GptOssConfig reads it: YaRN and base 150000 when it names no RoPE, and
    head_dim 64 when absent."""
    raw = dict(raw)
    params = raw.get("rope_parameters")
    if raw.get("rope_scaling") is None and not params:
        raw["rope_scaling"] = dict(YARN)
    theta_in_params = isinstance(params, dict) and params.get("rope_theta") is not None
    if raw.get("rope_theta") is None and not theta_in_params:
        raw["rope_theta"] = ROPE_THETA
    if raw.get("head_dim") is None:
        raw["head_dim"] = HEAD_DIM
    return raw


def moe_recipe(alpha: float, limit: float) -> MoeRecipe:
    # Softmax over the top k logits equals the softmax over all of them renormalised over the
    # k; the weights are rounded to the model dtype (transformers' softmax runs in it).
    return MoeRecipe(
        router="topk_softmax",
        renormalize=True,
        weights_in_dtype=True,
        router_bias=True,
        expert_bias=True,
        activation="swiglu_oai",
        swiglu_alpha=alpha,
        swiglu_limit=limit,
    )


def _config(fields: dict[str, Any], kinds: list[str], window: int) -> ModelConfig:
    layers = tuple(LayerRecipe(window=window if k == SLIDING else 0) for k in kinds)
    fields["sliding_window"] = window if SLIDING in kinds else None
    recipe = standard_recipe(fields, layers=layers, norm="rms_fp32_weight", attention_sinks=True)
    return ModelConfig(**fields, recipe=recipe)


def hf_config(f: ConfigFields, architecture: str) -> ModelConfig:
    f = ConfigFields(_with_defaults(f.raw), f.source, f.arch)
    common = common_fields(f, architecture, "gpt_oss")
    fields = common | decoder_fields(f, common)
    bias = f.flag("attention_bias", True)
    experts = f.size("num_local_experts", 128)
    top_k = f.size("num_experts_per_tok", 4)
    if top_k > experts:
        raise f.error("num_experts_per_tok", f"at most the {experts} experts", top_k)
    fields |= dict(
        norm_eps=f.number("rms_norm_eps", RMS_EPS),
        qkv_bias=bias,
        o_bias=bias,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=fields["intermediate_size"],
        norm_topk_prob=True,
        router_weights_in_dtype=True,
        moe=moe_recipe(f.number("swiglu_alpha", 1.702), f.number("swiglu_limit", 7.0)),
    )
    window = f.size("sliding_window", WINDOW)
    return _config(fields, _layer_kinds(f, common["num_layers"]), window)


_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks)?$")
_ROUTER = re.compile(r"\.mlp\.router\.(weight|bias)$")
# GGUF (through the common names): each stack's bias [E, rows] and the sinks' `.weight`
_GGUF_BIAS = re.compile(r"\.mlp\.experts\.(gate|up|down)_proj\.bias$")
_GGUF_SINKS = ".self_attn.sinks.weight"


def checkpoint_views(name: str, cfg: ModelConfig) -> list[tuple[str, Any, Any]] | None:
    """The pieces of a Hugging Face expert stack in cpud's layout, the router and the GGUF
    sinks under cpud's names, a GGUF stack's bias per expert (module doc)."""
    if _ROUTER.search(name):
        return renamed(name.replace(".mlp.router.", ".mlp.gate."))
    if name.endswith(_GGUF_SINKS):
        return renamed(name.removesuffix(".weight"))
    match = _GGUF_BIAS.search(name)
    if match is not None:
        return gguf_bias_views(name, match.group(1))
    match = _EXPERTS.search(name)
    if match is None:
        return None
    return expert_views(name, match.group(1), match.group(2) or "")


def gguf_config(m: GGUFMeta) -> ModelConfig:
    """What llama.cpp builds from a `gpt-oss` file (src/llama-model.cpp, LLM_ARCH_OPENAI_MOE):
    the window on even layers (set_swa_pattern(2)), YaRN as its metadata says (untruncated, as
    transformers runs gpt-oss), and the experts' SwiGLU with alpha 1.702 and limit 7.0, which
    llama.cpp hard-codes (files carry neither)."""
    from cpud.model.gguf_meta import decoder_fields as gguf_fields

    fields = gguf_fields(m) | dict(architecture=ARCHITECTURE, family="gpt_oss")
    if fields["rope_scaling"] is not None and fields["rope_scaling"]["rope_type"] == "yarn":
        fields["rope_scaling"] = fields["rope_scaling"] | {"truncate": False}
    experts, top_k = m.size("expert_count"), m.size("expert_used_count")
    if top_k > experts:
        raise m.error(f"{m.arch}.expert_used_count", f"at most expert_count {experts}", top_k)
    fields |= dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=m.size("expert_feed_forward_length"),
        norm_topk_prob=True,
        router_weights_in_dtype=True,
        moe=moe_recipe(1.702, 7.0),
    )
    window = m.size("attention.sliding_window")
    kinds = [SLIDING if i % 2 == 0 else FULL for i in range(fields["num_layers"])]
    return _config(fields, kinds, window)


def gguf_tensors(cfg: ModelConfig) -> dict[str, Any]:
    """The common table with post_attention_norm for ffn_norm, and per layer the sinks, the
    router's bias and each expert stack's bias."""
    from cpud.model.gguf_names import COLUMNS, ROWS, WHOLE, Expected, common_tensors

    table = common_tensors(cfg)
    e, inter, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    for i in range(cfg.num_layers):
        layer = f"blk.{i}"
        table[f"{layer}.post_attention_norm.weight"] = table.pop(f"{layer}.ffn_norm.weight")
        table[f"{layer}.attn_sinks.weight"] = Expected((cfg.num_heads,), ROWS)
        table[f"{layer}.ffn_gate_inp.bias"] = Expected((e,), WHOLE)
        table[f"{layer}.ffn_gate_exps.bias"] = Expected((e, inter), COLUMNS)
        table[f"{layer}.ffn_up_exps.bias"] = Expected((e, inter), COLUMNS)
        table[f"{layer}.ffn_down_exps.bias"] = Expected((e, h), WHOLE)
    return table


FAMILY = Family(
    name="gpt_oss",
    hf_architectures=(ARCHITECTURE,),
    hf_config=hf_config,
    gguf_architectures=("gpt-oss",),
    gguf_config=gguf_config,
    model="moe",
    gguf_layer_names={
        "post_attention_norm": "post_attention_layernorm",
        "attn_sinks": "self_attn.sinks",
    },
    gguf_tensors=gguf_tensors,
    checkpoint_views=checkpoint_views,
)
