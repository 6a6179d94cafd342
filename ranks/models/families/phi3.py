"""Phi-3, Phi-3.5-mini, Phi-4 and Phi-4-mini (Phi3ForCausalLM, GGUF `phi3`): Llama's layers
with q, k, v stacked in one qkv_proj and gate, up in one gate_up_proj (checkpoint and GGUF
alike: attn_qkv, and ffn_up holding gate then up), partial rotary (Phi-4-mini: 0.75 of each
head), LongRoPE scaling ("longrope", formerly "su": short and long per-frequency factors,
cpud.ranks.layers.rotary), optional sliding window, no biases.

transformers' Phi3Config reads the original context length from its own top-level key
(default 4096) over rope_scaling's and calls rope types "su" and "yarn" longrope. llama.cpp's
converter (Phi3MiniModel) writes the factors as the top-level tensors rope_factors_long and
rope_factors_short with phi3.rope.scaling.attn_factor and original_context_length, and the
window as phi3.attention.sliding_window (0: none); llama.cpp itself ignores that window, cpud
honours it as transformers does."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from cpud.model.model_config import (
    ConfigFields,
    ModelConfig,
    common_fields,
    decoder_config,
    decoder_fields,
)
from cpud.ranks.models.family import Family
from cpud.settings.errors import ConfigError

if TYPE_CHECKING:
    from cpud.model.gguf_meta import GGUFMeta

ARCHITECTURE = "Phi3ForCausalLM"
ORIGINAL_DEFAULT = 4096  # Phi3Config.original_max_position_embeddings
RMS_EPS_DEFAULT = 1e-5  # Phi3Config.rms_norm_eps
LONG, SHORT = "rope_factors_long.weight", "rope_factors_short.weight"


def _as_longrope(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json as transformers' Phi3Config reads it: "su" and "yarn" scaling are longrope,
    and the top-level original length (4096 when absent) is the one that counts."""
    raw = dict(raw)
    for key in ("rope_scaling", "rope_parameters"):
        scaling = raw.get(key)
        if isinstance(scaling, dict):
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind in ("su", "yarn"):
                raw[key] = dict(scaling, rope_type="longrope")
    if raw.get("original_max_position_embeddings") is None:
        raw["original_max_position_embeddings"] = ORIGINAL_DEFAULT
    return raw


def hf_config(f: ConfigFields, architecture: str) -> ModelConfig:
    f = ConfigFields(_as_longrope(f.raw), f.source, f.arch)
    common = common_fields(f, architecture, "phi3")
    fields = common | decoder_fields(f, common)
    fields |= dict(
        norm_eps=f.number("rms_norm_eps", RMS_EPS_DEFAULT),
        qkv_bias=False,  # Phi3Attention has none, whatever attention_bias says
        o_bias=False,
    )
    return decoder_config(fields)


def _factors(m: GGUFMeta, name: str, rotary_dim: int) -> list[float]:
    tensor = next((t for t in m.reader.tensors if t.name == name), None)
    if tensor is None:
        other = SHORT if name == LONG else LONG
        raise ConfigError(f"{m.source} holds {other} without {name}: convert the model again")
    values = np.asarray(tensor.data, dtype=np.float64).reshape(-1)
    if tensor.tensor_type.name not in ("F32", "F16") or values.size != rotary_dim // 2:
        raise ConfigError(
            f"{m.source}: {name} must hold {rotary_dim // 2} F32 or F16 values (half the rotary "
            f"dimension), got {values.size} {tensor.tensor_type.name}"
        )
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise ConfigError(f"{m.source}: {name} holds values that are not positive numbers")
    return [float(v) for v in values]


def _gguf_longrope(m: GGUFMeta, context: int, rotary_dim: int) -> dict[str, Any] | None:
    """LongRoPE from the factor tensors and their metadata, in the rope_scaling form the rotary
    layer reads; None when the file has no factors (Phi-3-mini-4k, Phi-4)."""
    if LONG not in m.tensors and SHORT not in m.tensors:
        return None
    original = m.size("rope.scaling.original_context_length")
    factor = context / original
    derived = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return {
        "rope_type": "longrope",
        "short_factor": _factors(m, SHORT, rotary_dim),
        "long_factor": _factors(m, LONG, rotary_dim),
        "original_max_position_embeddings": original,
        "factor": factor,
        "attention_factor": m.number("rope.scaling.attn_factor", derived),
    }


def gguf_config(m: GGUFMeta) -> ModelConfig:
    from cpud.model.gguf_meta import decoder_fields as gguf_fields

    fields = gguf_fields(m) | dict(architecture=ARCHITECTURE, family="phi3")
    if fields["rope_scaling"] is not None:
        raise ConfigError(
            f"{m.source}: a phi3 file with RoPE scaling other than its rope_factors tensors is "
            f"not supported"
        )
    rotary_dim = m.size("rope.dimension_count", fields["head_dim"])
    fields["rope_scaling"] = _gguf_longrope(m, fields["max_position_embeddings"], rotary_dim)
    window = m.get("attention.sliding_window", 0)
    fields["sliding_window"] = m.size("attention.sliding_window") if window else None
    return decoder_config(fields)


def gguf_tensors(cfg: ModelConfig) -> dict[str, Any]:
    """The common table with each layer's attn_q/k/v as one attn_qkv and ffn_gate/up as one
    ffn_up (gate rows, then up rows), and the LongRoPE factor tensors."""
    from cpud.model.gguf_names import ROWS, WHOLE, Expected, common_tensors

    table = common_tensors(cfg)
    h = cfg.hidden_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    for i in range(cfg.num_layers):
        for stem in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up"):
            del table[f"blk.{i}.{stem}.weight"]
        table[f"blk.{i}.attn_qkv.weight"] = Expected((qkv, h), ROWS)
        table[f"blk.{i}.ffn_up.weight"] = Expected((2 * cfg.intermediate_size, h), ROWS)
    if (cfg.rope_scaling or {}).get("rope_type") == "longrope":
        half = cfg.rotary_dim // 2
        table[LONG] = Expected((half,), WHOLE)
        table[SHORT] = Expected((half,), WHOLE)
    return table


def linear_ks(cfg: ModelConfig, tp: int) -> list[tuple[str, int]]:
    h, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim // tp
    first = "model.layers.0"
    return [
        (f"{first}.self_attn.qkv_proj.weight", h),
        (f"{first}.self_attn.o_proj.weight", q),
        (f"{first}.mlp.gate_up_proj.weight", h),
        (f"{first}.mlp.down_proj.weight", cfg.intermediate_size // tp),
    ]


FAMILY = Family(
    name="phi3",
    hf_architectures=(ARCHITECTURE,),
    hf_config=hf_config,
    gguf_architectures=("phi3",),
    gguf_config=gguf_config,
    fused_checkpoint=(
        ("qkv_proj", "qkv_proj", ("q", "k", "v")),
        ("gate_up_proj", "gate_up_proj", (0, 1)),
    ),
    gguf_layer_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    gguf_tensors=gguf_tensors,
    linear_ks=linear_ks,
    linears_per_layer=4,  # qkv, o, gate_up, down
)
