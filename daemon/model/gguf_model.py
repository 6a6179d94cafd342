"""A GGUF file's model: cpud's decoder config from the file's metadata, and the checks
(architecture, tensor names, shapes and types, the split for --tp) that make a bad file a
ConfigError before any rank starts. Reads metadata and tensor headers only."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.gguf_reader import ReaderTensor

from cpud.errors import ConfigError, one_line
from cpud.model.gguf_file import array_length, field_value, open_gguf
from cpud.model.gguf_header import shown
from cpud.model.gguf_names import COLUMNS, ROPE_FREQS, expected_tensors
from cpud.model.model_config import ModelConfig

# GGUF general.architecture -> the Hugging Face architecture cpud runs it as.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
# A `llama` file with experts (blk.N.ffn_gate_inp) is Mixtral.
LLAMA_WITH_EXPERTS = "MixtralForCausalLM"
SUPPORTED_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
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


@dataclass(frozen=True)
class GGUFModel:
    path: Path
    architecture: str  # the file's general.architecture
    config: ModelConfig
    tensors: dict[str, TensorInfo]
    # The tensors' data, memory mapped, in file order, until mapped_tensors hands it to a
    # loader; the reader's parsed metadata (tens of MB for a large vocabulary) is not kept.
    data: dict[str, ReaderTensor] = field(default_factory=dict, repr=False, compare=False)
    # The tokenizer.* keys (and general.architecture) as values, read in the same parse so
    # that cpud.gguf_tokenizer does not parse the file again; empty when built from facts.
    tokenizer_keys: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def bytes_by_type(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for info in self.tensors.values():
            totals[info.type] = totals.get(info.type, 0) + info.n_bytes
        return totals


def _short(value: Any) -> str:
    """A metadata value as an error message shows it: its repr, cut to one short line."""
    return one_line(repr(value), 80)


class _Meta:
    """Typed reads of `{arch}.` metadata keys; errors name the file and the key."""

    def __init__(self, reader: GGUFReader, arch: str, source: str):
        self.reader, self.arch, self.source = reader, arch, source

    def error(self, key: str, wanted: str, value: Any) -> ConfigError:
        return ConfigError(
            f"{self.source}: GGUF metadata {key} must be {wanted}, got {_short(value)}"
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


def _rope_scaling(
    m: _Meta, reader: GGUFReader, context: int, rotary_dim: int
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
                f"{m.source}: {ROPE_FREQS} together with {_short(kind)} RoPE scaling is not "
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
        f"{m.source}: RoPE scaling {_short(kind)} is not supported (none, linear, yarn, "
        f"and llama3 as a {ROPE_FREQS} tensor)"
    )


def _token_id(reader: GGUFReader, key: str) -> int | None:
    value = field_value(reader, f"tokenizer.ggml.{key}", None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _layers(m: _Meta, tensors: dict[str, TensorInfo]) -> int:
    """block_count, at most the number of tensors (every layer has some): the tensor names a
    config implies are listed per layer."""
    layers = m.size("block_count")
    if layers > len(tensors):
        raise m.error(
            f"{m.arch}.block_count", f"at most the file's tensor count {len(tensors)}", layers
        )
    return layers


def _checkpoint_dtype(tensors: dict[str, TensorInfo]) -> str | None:
    """The float type every matrix is stored in, None when any is quantized (or types mix)."""
    types = {t.type for t in tensors.values() if len(t.shape) == 2}
    return _FLOAT_TYPES.get(types.pop()) if len(types) == 1 else None


def _config(
    reader: GGUFReader, arch: str, source: str, tensors: dict[str, TensorInfo]
) -> ModelConfig:
    m = _Meta(reader, arch, source)
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
    eos = (_token_id(reader, "eos_token_id"), _token_id(reader, "eot_token_id"))
    moe = _moe_fields(m, arch, tensors)
    architecture = ARCHITECTURES[arch]
    if arch == "llama" and moe:
        architecture = LLAMA_WITH_EXPERTS
    return ModelConfig(
        architecture=architecture,
        model_type=arch,
        hidden_size=hidden,
        num_layers=_layers(m, tensors),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=m.size("feed_forward_length"),
        vocab_size=vocab,
        max_position_embeddings=context,
        norm_eps=m.number("attention.layer_norm_rms_epsilon"),
        tie_word_embeddings="output.weight" not in tensors,
        checkpoint_dtype=_checkpoint_dtype(tensors),
        rope_theta=m.number("rope.freq_base", 10000.0),
        rope_scaling=_rope_scaling(m, reader, context, rotary_dim),
        partial_rotary_factor=rotary_dim / head_dim,
        qkv_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
        o_bias="blk.0.attn_output.bias" in tensors,
        qk_norm=arch in ("qwen3", "qwen3moe"),
        bos_token_id=_token_id(reader, "bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(t for t in eos if t is not None)),
        **moe,
    )


def _moe_fields(m: _Meta, arch: str, tensors: dict[str, TensorInfo]) -> dict[str, Any]:
    """Experts from the metadata; a layer without blk.N.ffn_gate_inp keeps a dense MLP. Both
    families renormalise the top-k weights (llama.cpp does for qwen3moe and llama)."""
    if m.get("expert_count") is None and arch != "qwen3moe":
        return {}
    experts, top_k = m.size("expert_count"), m.size("expert_used_count")
    if top_k > experts:
        raise m.error(f"{arch}.expert_used_count", f"at most expert_count {experts}", top_k)
    layers = _layers(m, tensors)
    dense = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors)
    inter_key = "expert_feed_forward_length" if arch == "qwen3moe" else "feed_forward_length"
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=m.size(inter_key),
        norm_topk_prob=True,
        router_weights_in_dtype=arch == "qwen3moe",
        dense_layers=dense,
    )


def _tensor_infos(reader: GGUFReader) -> dict[str, TensorInfo]:
    return {
        t.name: TensorInfo(
            t.name,
            t.tensor_type.name,
            tuple(int(d) for d in reversed(t.shape.tolist())),
            int(t.n_bytes),
        )
        for t in reader.tensors
    }


def _check_tensors(model: GGUFModel) -> None:
    source = model.path
    for info in model.tensors.values():
        if info.type not in SUPPORTED_TYPES:
            raise ConfigError(
                f"{source}: tensor {shown(info.name)} is {info.type}, a type cpud does not load "
                f"(supported: {', '.join(SUPPORTED_TYPES)}); use a file quantized to one of those"
            )
    expected = expected_tensors(model.config)
    for name, info in model.tensors.items():
        if name == ROPE_FREQS:
            continue
        spec = expected.get(name)
        if spec is None:
            raise ConfigError(
                f"{source} holds tensor {shown(name)}, which cpud's {model.architecture} decoder "
                f"does not have: the file's metadata does not match its tensors (convert it again)"
            )
        if spec.shape != info.shape:
            raise ConfigError(
                f"{source}: tensor {name} has shape {info.shape}, but the file's metadata "
                f"implies {spec.shape} (convert the model again)"
            )
    missing = [name for name in expected if name not in model.tensors]
    if missing:
        raise ConfigError(
            f"{source} lacks tensor {missing[0]} and {len(missing) - 1} more: the file is "
            f"incomplete (convert the model again)"
        )


def _identity(path: Path) -> tuple[str, int, int]:
    try:
        st = path.stat()
    except OSError as exc:
        raise ConfigError(f"{path} cannot be read: {exc.strerror or exc}") from None
    return str(path.resolve()), st.st_size, st.st_mtime_ns


_CACHE: dict[tuple[str, int, int], GGUFModel] = {}
_CACHE_SIZE = 4


def _read(identity: tuple[str, int, int]) -> GGUFModel:
    path = Path(identity[0])
    reader = open_gguf(path)
    arch = field_value(reader, "general.architecture", None)
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise ConfigError(
            f"{path}: GGUF architecture {_short(arch)} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    splits = field_value(reader, "split.count", 1)
    if splits != 1:
        raise ConfigError(
            f"{path} is one part of a {_short(splits)}-file split GGUF: merge the parts into one "
            f"file (llama-gguf-split --merge) and pass that"
        )
    tensors = _tensor_infos(reader)
    config = _config(reader, arch, str(path), tensors)
    keys = [k for k in reader.fields if k.startswith("tokenizer.") or k == "general.architecture"]
    data = {t.name: t for t in reader.tensors}
    model = GGUFModel(
        path, arch, config, tensors, data, {key: field_value(reader, key) for key in keys}
    )
    _check_tensors(model)
    return model


def read_gguf_model(path: str | os.PathLike) -> GGUFModel:
    """The file's architecture, config and tensor list, checked; cached per file version."""
    identity = _identity(Path(path))
    model = _CACHE.get(identity)
    if model is None:
        model = _read(identity)
        while len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[identity] = model
    return model


def cached_gguf_model(path: str | os.PathLike) -> GGUFModel | None:
    """The file's model if this process has read this version of it already (no parse)."""
    try:
        return _CACHE.get(_identity(Path(path)))
    except ConfigError:
        return None


def remember_gguf_model(model: GGUFModel, size: int, mtime_ns: int) -> bool:
    """Files `model`, built from what a checked read of the file found (in another process),
    as this process's read of it; False (nothing filed) when the file is no longer of that
    size and mtime."""
    identity = _identity(model.path)
    if identity[1:] != (size, mtime_ns):
        return False
    while len(_CACHE) >= _CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[identity] = model
    return True


def mapped_tensors(path: str | os.PathLike) -> dict[str, ReaderTensor]:
    """The file's tensors, memory mapped, in file order; the cache keeps no reference to them,
    so the mapping goes when the caller (a loader) drops them. The first call after the config
    was read takes its reader's tensors; later ones open the file again."""
    model = read_gguf_model(path)
    data = model.data or {t.name: t for t in open_gguf(model.path).tensors}
    _CACHE[_identity(model.path)] = replace(model, data={})
    return data


def gguf_model_config(path: str | os.PathLike) -> ModelConfig:
    return read_gguf_model(path).config


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, min(n, 64) + 1) if n % d == 0)


def check_gguf_split(model: GGUFModel, tp: int) -> None:
    """ConfigError naming the first tensor that cannot be split for --tp: heads and the MLP width
    must divide, and each rank's range of a row-parallel matrix must be whole blocks."""
    cfg = model.config
    if tp == 1:
        return
    if cfg.num_heads % tp:
        raise ConfigError(
            f"{model.path}: blk.0.attn_q.weight holds {cfg.num_heads} heads, which do not split "
            f"across --tp {tp}: use a --tp among {_divisors(cfg.num_heads)}"
        )
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        raise ConfigError(
            f"{model.path}: blk.0.attn_k.weight holds {cfg.num_kv_heads} KV heads, which neither "
            f"split across nor replicate evenly over --tp {tp}"
        )
    if cfg.is_moe and cfg.moe_intermediate_size % tp:
        raise ConfigError(
            f"{model.path}: the experts' {cfg.moe_intermediate_size} rows do not split across "
            f"--tp {tp}: use a --tp among {_divisors(cfg.moe_intermediate_size)}"
        )
    if cfg.intermediate_size % tp and len(cfg.dense_layers) + (not cfg.is_moe):
        raise ConfigError(
            f"{model.path}: blk.0.ffn_up.weight has {cfg.intermediate_size} rows, which do not "
            f"split across --tp {tp}: use a --tp among {_divisors(cfg.intermediate_size)}"
        )
    for name, spec in expected_tensors(cfg).items():
        info = model.tensors[name]
        if spec.split != COLUMNS:
            continue
        columns = info.shape[-1]
        if (columns // tp) % info.block_size:
            blocks = columns // info.block_size
            raise ConfigError(
                f"{model.path}: tensor {name} ({info.type}, blocks of {info.block_size} values) "
                f"has {columns} columns, which do not split into whole blocks across --tp {tp}: "
                f"use a --tp among {_divisors(blocks)}"
            )
