"""BERT encoders (bge, e5, all-MiniLM and other sentence-transformers BertModel checkpoints;
GGUF `bert` as llama.cpp's converter writes it): absolute position and token type embeddings,
post-norm LayerNorm layers, exact GELU, bidirectional attention. An embedding model only: its
own torch module (ranks/models/encoder.py), no KV cache, no generation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cpud.model.model_config import ConfigFields, ModelConfig, common_fields
from cpud.ranks.models.family import Family
from cpud.settings.errors import ConfigError

if TYPE_CHECKING:
    from cpud.model.gguf_meta import GGUFMeta

ACTIVATIONS = ("gelu",)  # transformers' "gelu": the exact (erf) form
# 2-D tensors llama.cpp's converter keeps in F32 whatever the file type
F32_TABLES = ("token_types.weight", "position_embd.weight")


def _heads(source: str, hidden: int, heads: int, hidden_key: str, heads_key: str) -> int:
    if hidden % heads:
        raise ConfigError(
            f"{source}: {hidden_key} {hidden} is not a multiple of {heads_key} {heads}"
        )
    return hidden // heads


def encoder_fields(common: dict[str, Any], head_dim: int, **fields: Any) -> ModelConfig:
    """A BERT encoder's ModelConfig: every projection has a bias, no LM head, no recipe."""
    return ModelConfig(
        **common,
        num_kv_heads=common["num_heads"],
        head_dim=head_dim,
        tie_word_embeddings=False,
        qkv_bias=True,
        o_bias=True,
        hidden_act="gelu",
        generates=False,
        **fields,
    )


def hf_config(f: ConfigFields, architecture: str) -> ModelConfig:
    common = common_fields(f, architecture, "bert")
    head_dim = _heads(
        f.source,
        common["hidden_size"],
        common["num_heads"],
        "hidden_size",
        "num_attention_heads",
    )
    act = f.text("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise ConfigError(
            f"{f.source}: hidden_act {act!r} is not supported for BERT ({', '.join(ACTIVATIONS)})"
        )
    positions = f.text("position_embedding_type", "absolute")
    if positions != "absolute":
        raise ConfigError(
            f"{f.source}: position_embedding_type {positions!r} is not supported for BERT "
            f"(absolute)"
        )
    if f.flag("is_decoder", False) or f.flag("add_cross_attention", False):
        raise ConfigError(f"{f.source}: a BERT decoder (is_decoder) is not supported")
    return encoder_fields(
        common,
        head_dim,
        intermediate_size=f.size("intermediate_size"),
        max_position_embeddings=f.size("max_position_embeddings", 512),
        norm_eps=f.number("layer_norm_eps", 1e-12),
        type_vocab_size=f.size("type_vocab_size", 2),
    )


def gguf_config(m: GGUFMeta) -> ModelConfig:
    from cpud.model.gguf_meta import checkpoint_dtype, layers, token_id

    tensors = m.tensors
    if m.get("attention.causal", False) is not False:
        raise m.error(f"{m.arch}.attention.causal", "false (a bidirectional encoder)", True)
    hidden, heads = m.size("embedding_length"), m.size("attention.head_count")
    if m.size("attention.head_count_kv", heads) != heads:
        key = "attention.head_count_kv"
        raise m.error(f"{m.arch}.{key}", f"head_count {heads}", m.get(key))
    embedding = tensors.get("token_embd.weight")
    types = tensors.get("token_types.weight")
    common = dict(
        architecture="BertModel",
        family="bert",
        model_type=m.arch,
        hidden_size=hidden,
        num_layers=layers(m, tensors),
        num_heads=heads,
        vocab_size=m.size("vocab_size", embedding.shape[0] if embedding else None),
        checkpoint_dtype=checkpoint_dtype(
            {n: t for n, t in tensors.items() if n not in F32_TABLES}
        ),
        bos_token_id=token_id(m.reader, "bos_token_id"),
        eos_token_ids=(),
    )
    head_dim = _heads(m.source, hidden, heads, "embedding_length", "attention.head_count")
    return encoder_fields(
        common,
        head_dim,
        intermediate_size=m.size("feed_forward_length"),
        max_position_embeddings=m.size("context_length"),
        norm_eps=m.number("attention.layer_norm_epsilon"),
        type_vocab_size=types.shape[0] if types else 1,
    )


def gguf_tensors(cfg: ModelConfig) -> dict[str, Any]:
    """The tensors of llama.cpp's `bert` (convert_hf_to_gguf BertModel)."""
    from cpud.model.gguf_names import COLUMNS, ROWS, WHOLE, Expected

    h, ffn = cfg.hidden_size, cfg.intermediate_size
    out = {
        "token_embd.weight": Expected((cfg.vocab_size, h), ROWS),
        "token_types.weight": Expected((cfg.type_vocab_size, h), WHOLE),
        "position_embd.weight": Expected((cfg.max_position_embeddings, h), WHOLE),
        "token_embd_norm.weight": Expected((h,), WHOLE),
        "token_embd_norm.bias": Expected((h,), WHOLE),
    }
    for i in range(cfg.num_layers):
        layer = {
            "attn_output.weight": Expected((h, h), COLUMNS),
            "attn_output.bias": Expected((h,), WHOLE),
            "ffn_up.weight": Expected((ffn, h), ROWS),
            "ffn_up.bias": Expected((ffn,), ROWS),
            "ffn_down.weight": Expected((h, ffn), COLUMNS),
            "ffn_down.bias": Expected((h,), WHOLE),
        }
        for stem in ("attn_q", "attn_k", "attn_v"):
            layer[f"{stem}.weight"] = Expected((h, h), ROWS)
            layer[f"{stem}.bias"] = Expected((h,), ROWS)
        for stem in ("attn_output_norm", "layer_output_norm"):
            layer[f"{stem}.weight"] = Expected((h,), WHOLE)
            layer[f"{stem}.bias"] = Expected((h,), WHOLE)
        out.update((f"blk.{i}.{name}", spec) for name, spec in layer.items())
    return out


def linear_ks(cfg: ModelConfig, tp: int) -> list[tuple[str, int]]:
    h = cfg.hidden_size
    first = "encoder.layer.0"
    return [
        (f"{first}.attention.self.query.weight", h),
        (f"{first}.attention.output.dense.weight", h // tp),
        (f"{first}.intermediate.dense.weight", h),
        (f"{first}.output.dense.weight", cfg.intermediate_size // tp),
    ]


FAMILY = Family(
    name="bert",
    hf_architectures=("BertModel",),
    hf_config=hf_config,
    gguf_architectures=("bert",),
    gguf_config=gguf_config,
    model="encoder",
    gguf_top_names={
        "token_types": "model.embed_token_types",
        "position_embd": "model.embed_positions",
        "token_embd_norm": "model.embed_norm",
    },
    gguf_layer_names={
        "attn_output_norm": "attention_layernorm",
        "layer_output_norm": "output_layernorm",
    },
    gguf_tensors=gguf_tensors,
    linear_ks=linear_ks,
    linears_per_layer=6,  # q, k, v, o, up, down
)
