"""llama.cpp's tensor names for cpud's Llama-family decoder: the Hugging Face name each one
maps to, the shape the model config implies, and which axis tensor parallelism splits."""

from __future__ import annotations

from dataclasses import dataclass

from cpud.model.model_config import ModelConfig

ROWS = "rows"  # column-parallel and vocab-parallel: each rank reads whole rows
COLUMNS = "columns"  # row-parallel: each rank reads a range of every row
WHOLE = "whole"  # replicated

ROPE_FREQS = "rope_freqs.weight"  # llama3 RoPE factors: read into the config, not a parameter

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
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor; None for one the decoder has no parameter for."""
    stem, _, suffix = name.rpartition(".")
    if stem in _TOP:
        return f"{_TOP[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER:
        return f"model.layers.{int(parts[1])}.{_LAYER[parts[2]]}.{suffix}"
    return None


@dataclass(frozen=True)
class Expected:
    shape: tuple[int, ...]  # Hugging Face order: ([experts,] rows, columns) for matrices
    split: str  # ROWS, COLUMNS or WHOLE


def expected_tensors(cfg: ModelConfig) -> dict[str, Expected]:
    """Every tensor a GGUF file of this config holds (llama.cpp's names), rope_freqs aside."""
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
        out.update((f"blk.{i}.{name}", spec) for name, spec in layer.items())
    return out
