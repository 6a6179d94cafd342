"""Typed reads of a GGUF file's metadata for the family modules (ranks/models/families/):
the `{arch}.` keys, RoPE scaling as llama.cpp stores it, and the fields of a Llama-shaped
decoder. Errors name the file and the key."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from cpud.model.gguf_file import array_length, field_value
from cpud.settings.errors import ConfigError, one_line

ROPE_FREQS = "rope_freqs.weight"  # llama3 RoPE factors: read into the config, not a parameter
_FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: str  # GGML type name: "Q4_K", "F32", ...
    shape: tuple[int, ...]  # Hugging Face order: (rows, columns) for matrices
    n_bytes: int

    @property
    def block_size(self) -> int:
        """Values per block along a row (1 for float types)."""
        return GGML_QUANT_SIZES[GGMLQuantizationType[self.type]][0]


def short(value: Any) -> str:
    """A metadata value as an error message shows it: its repr, cut to one short line."""
    return one_line(repr(value), 80)


class GGUFMeta:
    """Typed reads of `{arch}.` metadata keys; errors name the file and the key."""

    def __init__(self, reader: GGUFReader, arch: str, source: str, tensors: dict[str, TensorInfo]):
        self.reader, self.arch, self.source, self.tensors = reader, arch, source, tensors

    def error(self, key: str, wanted: str, value: Any) -> ConfigError:
        return ConfigError(
            f"{self.source}: GGUF metadata {key} must be {wanted}, got {short(value)}"
        )

    def get(self, key: str, default: Any = None) -> Any:
        return field_value(self.reader, f"{self.arch}.{key}", default)

    def size(self, key: str, default: Any = None) -> int:
        value = self.get(key, default)
        if isinstance(value, list) and value and all(v == value[0] for v in value):
            value = value[0]  # a per-layer array with one value throughout
        if value is None:
            raise ConfigError(f"{self.source}: GGUF metadata lacks {self.arch}.{key}")
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**31:
            raise self.error(
                f"{self.arch}.{key}", "a positive integer (the same for every layer)", value
            )
        return value

    def number(self, key: str, default: float | None = None) -> float:
        value = self.get(key, default)
        if value is None:
            raise ConfigError(f"{self.source}: GGUF metadata lacks {self.arch}.{key}")
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not (math.isfinite(value) and value > 0)
        ):
            raise self.error(f"{self.arch}.{key}", "a positive number", value)
        return float(value)


def rope_scaling(
    m: GGUFMeta, reader: GGUFReader, context: int, rotary_dim: int
) -> dict[str, Any] | None:
    """RoPE scaling as llama.cpp stores it, in the rope_scaling form cpud's rotary layer reads:
    linear and YaRN from metadata, llama3 as per-frequency divisors in a rope_freqs tensor."""
    kind = m.get("rope.scaling.type", None)
    legacy_linear = m.get("rope.scale_linear", None)
    if kind is None and legacy_linear not in (None, 1.0):
        kind = "linear"
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:
        if kind not in (None, "none"):
            raise ConfigError(
                f"{m.source}: {ROPE_FREQS} together with {short(kind)} RoPE scaling is not "
                f"supported"
            )
        if freqs.tensor_type.name not in ("F32", "F16") or int(freqs.n_elements) != rotary_dim // 2:
            raise ConfigError(
                f"{m.source}: {ROPE_FREQS} must hold {rotary_dim // 2} F32 or F16 values, "
                f"got {int(freqs.n_elements)} {freqs.tensor_type.name}"
            )
        factors = np.asarray(freqs.data, dtype=np.float64).reshape(-1)
        if not (np.isfinite(factors).all() and (factors > 0).all()):
            raise ConfigError(
                f"{m.source}: {ROPE_FREQS} holds values that are not positive numbers"
            )
        return {"rope_type": "factors", "factors": [float(f) for f in factors]}  # as JSON reads
    if kind in (None, "none"):
        return None
    if kind == "linear":
        factor = m.number("rope.scaling.factor", legacy_linear)
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        factor = m.number("rope.scaling.factor")
        if m.get("rope.scaling.yarn_ext_factor", 1.0) not in (1.0, -1.0):
            raise ConfigError(
                f"{m.source}: YaRN with an extrapolation factor other than 1 is not supported"
            )
        mscale = 1.0 + 0.1 * math.log(factor) if factor > 1 else 1.0
        return {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": m.size(
                "rope.scaling.original_context_length", context
            ),
            "beta_fast": m.number("rope.scaling.yarn_beta_fast", 32.0),
            "beta_slow": m.number("rope.scaling.yarn_beta_slow", 1.0),
            # llama.cpp multiplies YaRN's own magnitude scaling by attn_factor
            "attention_factor": m.number("rope.scaling.yarn_attn_factor", 1.0) * mscale,
        }
    raise ConfigError(
        f"{m.source}: RoPE scaling {short(kind)} is not supported (none, linear, yarn, "
        f"and llama3 as a {ROPE_FREQS} tensor)"
    )


def token_id(reader: GGUFReader, key: str) -> int | None:
    value = field_value(reader, f"tokenizer.ggml.{key}", None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def layers(m: GGUFMeta, tensors: dict[str, TensorInfo]) -> int:
    """block_count, at most the number of tensors (every layer has some): the tensor names a
    config implies are listed per layer."""
    layers = m.size("block_count")
    if layers > len(tensors):
        raise m.error(
            f"{m.arch}.block_count", f"at most the file's tensor count {len(tensors)}", layers
        )
    return layers


def checkpoint_dtype(tensors: dict[str, TensorInfo]) -> str | None:
    """The float type every matrix is stored in, None when any is quantized (or types mix)."""
    types = {t.type for t in tensors.values() if len(t.shape) == 2}
    return _FLOAT_TYPES.get(types.pop()) if len(types) == 1 else None


def decoder_fields(m: GGUFMeta) -> dict[str, Any]:
    """The fields of a Llama-shaped decoder from the `{arch}.` keys; a family adds its own
    (architecture, family, biases, norms) and builds its recipe."""
    reader, arch, source, tensors = m.reader, m.arch, m.source, m.tensors
    hidden, heads = m.size("embedding_length"), m.size("attention.head_count")
    kv_heads = m.size("attention.head_count_kv", heads)
    if heads % kv_heads:
        raise m.error(
            f"{arch}.attention.head_count_kv", f"a divisor of head_count {heads}", kv_heads
        )
    if m.get("attention.key_length") is None and hidden % heads:
        raise ConfigError(
            f"{source}: embedding_length {hidden} is not a multiple of head_count {heads} "
            f"(and no attention.key_length is given)"
        )
    head_dim = m.size("attention.key_length", hidden // heads)
    if m.size("attention.value_length", head_dim) != head_dim:
        raise m.error(
            f"{arch}.attention.value_length",
            f"key_length {head_dim}",
            m.get("attention.value_length"),
        )
    rotary_dim = m.size("rope.dimension_count", head_dim)
    if rotary_dim > head_dim or rotary_dim % 2:
        raise m.error(
            f"{arch}.rope.dimension_count", f"even and at most the head size {head_dim}", rotary_dim
        )
    embedding = tensors.get("token_embd.weight")
    tokens = array_length(reader, "tokenizer.ggml.tokens")
    vocab = m.size("vocab_size", tokens or (embedding.shape[0] if embedding else None))
    context = m.size("context_length")
    eos = (token_id(reader, "eos_token_id"), token_id(reader, "eot_token_id"))
    return dict(
        model_type=arch,
        hidden_size=hidden,
        num_layers=layers(m, tensors),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=m.size("feed_forward_length"),
        vocab_size=vocab,
        max_position_embeddings=context,
        norm_eps=m.number("attention.layer_norm_rms_epsilon"),
        tie_word_embeddings="output.weight" not in tensors,
        checkpoint_dtype=checkpoint_dtype(tensors),
        rope_theta=m.number("rope.freq_base", 10000.0),
        rope_scaling=rope_scaling(m, reader, context, rotary_dim),
        partial_rotary_factor=rotary_dim / head_dim,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        o_bias="blk.0.attn_output.bias" in tensors,
        bos_token_id=token_id(reader, "bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(t for t in eos if t is not None)),
    )
