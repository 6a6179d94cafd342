"""OPT: learned positions, LayerNorm, ReLU/GELU MLP with biases (its own torch model,
ranks/models/opt.py; no decoder recipe, so the per-op path runs it)."""

from __future__ import annotations

from cpud.model.model_config import ConfigFields, ModelConfig, common_fields
from cpud.ranks.models.family import Family
from cpud.settings.errors import ConfigError


def hf_config(f: ConfigFields, architecture: str) -> ModelConfig:
    common = common_fields(f, architecture, "opt")
    hidden, heads = common["hidden_size"], common["num_heads"]
    act = f.text("activation_function", "relu")
    if act not in ("relu", "gelu"):
        raise ConfigError(f"{f.source}: OPT activation {act!r} is not supported (relu, gelu)")
    if hidden % heads:
        raise ConfigError(
            f"{f.source}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
        )
    return ModelConfig(
        **common,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=f.size("ffn_dim"),
        max_position_embeddings=f.size("max_position_embeddings"),
        norm_eps=1e-5,
        tie_word_embeddings=f.flag("tie_word_embeddings", True),
        hidden_act=act,
        word_embed_proj_dim=f.size("word_embed_proj_dim", hidden),
        do_layer_norm_before=f.flag("do_layer_norm_before", True),
        enable_bias=f.flag("enable_bias", True),
    )


def linear_ks(cfg: ModelConfig, tp: int) -> list[tuple[str, int]]:
    h, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim // tp
    first = "model.layers.0"
    return [
        (f"{first}.self_attn.q_proj.weight", h),
        (f"{first}.self_attn.out_proj.weight", q),
        (f"{first}.fc1.weight", h),
        (f"{first}.fc2.weight", cfg.intermediate_size // tp),
    ]


FAMILY = Family(
    name="opt",
    hf_architectures=("OPTForCausalLM",),
    hf_config=hf_config,
    model="opt",
    linear_ks=linear_ks,
    linears_per_layer=6,
)
