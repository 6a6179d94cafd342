"""llama.cpp's tensor names for cpud's decoder: the module name each one maps to (the common
table, plus a family's own, ranks/models/registry.py), the shape the model config implies, and
which axis tensor parallelism splits."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from cpud.model.gguf_meta import ROPE_FREQS
from cpud.model.model_config import ModelConfig
from cpud.ranks.models import registry

__all__ = [
    "COLUMNS",
    "ROPE_FREQS",
    "ROWS",
    "WHOLE",
    "Expected",
    "expected_tensors",
    "hf_name",
    "with_fused_gate_up",
]

ROWS = "rows"  # column-parallel and vocab-parallel: each rank reads whole rows
COLUMNS = "columns"  # row-parallel: each rank reads a range of every row
WHOLE = "whole"  # replicated


_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    # An expert layer's stacks: [experts, rows, columns], every expert in one tensor
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj",  # gate rows, then up rows (one stack)
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    # sandwich norms (Gemma): on the attention output and on the feed-forward output
    "post_attention_norm": "attn_out_norm",
    "post_ffw_norm": "ffn_out_norm",
}


def hf_name(name: str, family: str = "llama") -> str | None:
    """The module name (Hugging Face's where cpud keeps it) of a GGUF tensor of `family`;
    None for one the decoder has no parameter for."""
    stem, _, suffix = name.rpartition(".")
    own = registry.by_name(family)
    top = {**_TOP, **own.gguf_top_names}
    if stem in top:
        return f"{top[stem]}.{suffix}"
    parts = stem.split(".")
    layer = {**_LAYER, **own.gguf_layer_names}
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer:
        return f"model.layers.{int(parts[1])}.{layer[parts[2]]}.{suffix}"
    return None


@dataclass(frozen=True)
class Expected:
    shape: tuple[int, ...]  # Hugging Face order: ([experts,] rows, columns) for matrices
    split: str  # ROWS, COLUMNS or WHOLE


def expected_tensors(cfg: ModelConfig) -> dict[str, Expected]:
    """Every tensor a GGUF file of this config holds (llama.cpp's names), rope_freqs aside."""
    own = registry.by_name(cfg.family).gguf_tensors
    return own(cfg) if own is not None else common_tensors(cfg)


def common_tensors(cfg: ModelConfig) -> dict[str, Expected]:
    """The tensors of a Llama-shaped decoder with this config and recipe, llama.cpp's names."""
    sandwich = cfg.recipe is not None and cfg.recipe.sandwich_norms
    h, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    kv, ffn = cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    out = {
        "token_embd.weight": Expected((cfg.vocab_size, h), ROWS),
        "output_norm.weight": Expected((h,), WHOLE),
    }
    if not cfg.tie_word_embeddings:
        out["output.weight"] = Expected((cfg.vocab_size, h), ROWS)
    for i in range(cfg.num_layers):
        layer = {
            "attn_norm.weight": Expected((h,), WHOLE),
            "attn_q.weight": Expected((q, h), ROWS),
            "attn_k.weight": Expected((kv, h), ROWS),
            "attn_v.weight": Expected((kv, h), ROWS),
            "attn_output.weight": Expected((h, q), COLUMNS),
            "ffn_norm.weight": Expected((h,), WHOLE),
        }
        if cfg.moe_layer(i):
            e, inter = cfg.num_experts, cfg.moe_intermediate_size
            layer["ffn_gate_inp.weight"] = Expected((e, h), WHOLE)
            layer["ffn_gate_exps.weight"] = Expected((e, inter, h), ROWS)
            layer["ffn_up_exps.weight"] = Expected((e, inter, h), ROWS)
            layer["ffn_down_exps.weight"] = Expected((e, h, inter), COLUMNS)
        else:
            layer["ffn_gate.weight"] = Expected((ffn, h), ROWS)
            layer["ffn_up.weight"] = Expected((ffn, h), ROWS)
            layer["ffn_down.weight"] = Expected((h, ffn), COLUMNS)
        if cfg.qkv_bias:
            layer["attn_q.bias"] = Expected((q,), ROWS)
            layer["attn_k.bias"] = Expected((kv,), ROWS)
            layer["attn_v.bias"] = Expected((kv,), ROWS)
        if cfg.o_bias:
            layer["attn_output.bias"] = Expected((h,), WHOLE)
        if cfg.qk_norm:
            layer["attn_q_norm.weight"] = Expected((cfg.head_dim,), WHOLE)
            layer["attn_k_norm.weight"] = Expected((cfg.head_dim,), WHOLE)
        if sandwich:
            layer["post_attention_norm.weight"] = Expected((h,), WHOLE)
            layer["post_ffw_norm.weight"] = Expected((h,), WHOLE)
        out.update((f"blk.{i}.{name}", spec) for name, spec in layer.items())
    return out


def with_fused_gate_up(expected: dict[str, Expected], names: Iterable[str]) -> dict[str, Expected]:
    """`expected` for a file whose tensor `names` stack a layer's gate and up experts in one
    blk.N.ffn_gate_up_exps.weight [E, 2 I, H] (gate rows, then up rows; llama.cpp's converter
    under --fuse-gate-up-exps) in place of ffn_gate_exps and ffn_up_exps, and where the file
    has it, blk.N.ffn_gate_up_exps.bias [E, 2 I] in place of their two biases."""
    out = dict(expected)
    for name in names:
        if not name.endswith(".ffn_gate_up_exps.weight"):
            continue
        stem = name.removesuffix("gate_up_exps.weight")
        gate, up = out.get(f"{stem}gate_exps.weight"), out.get(f"{stem}up_exps.weight")
        if gate is None or up is None:
            continue
        del out[f"{stem}gate_exps.weight"], out[f"{stem}up_exps.weight"]
        experts, rows, columns = gate.shape
        out[name] = Expected((experts, rows + up.shape[1], columns), ROWS)
        bias = f"{stem}gate_up_exps.bias"  # [E, 2 I]: the two biases, gate first
        if bias in names and f"{stem}gate_exps.bias" in out:
            gate_bias, up_bias = out.pop(f"{stem}gate_exps.bias"), out.pop(f"{stem}up_exps.bias")
            out[bias] = Expected((experts, gate_bias.shape[1] + up_bias.shape[1]), gate_bias.split)
    return out
