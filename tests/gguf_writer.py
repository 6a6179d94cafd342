"""Fixture models written as GGUF files the way llama.cpp's convert_hf_to_gguf.py writes them:
its metadata keys (TextModel / LlamaModel / Qwen2Model set_gguf_parameters), its tensor names,
its Q/K row permutation for the `llama` architecture, llama3 RoPE scaling as a rope_freqs
tensor, 1-D tensors in F32 and 2-D weights in the tensor type asked for (gguf.quants quantizes
the legacy types, tests/gguf_kquants.py packs the K-quants)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from unittest import mock

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf_kquants import PACKERS, quantize_k
from gguf_vocab import add_tokenizer_metadata
from safetensors.numpy import load_file

from cpud.fixtures import make_model, presets
from cpud.fixtures.archs import ARCH_MODULES

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
GGUF_ARCH |= {a: m.GGUF_ARCH for a, m in ARCH_MODULES.items() if hasattr(m, "GGUF_ARCH")}
# Fixture architectures beyond `llama` whose converter permutes Q/K rows (a LlamaModel)
PERMUTED_QK = {a for a, m in ARCH_MODULES.items() if getattr(m, "GGUF_PERMUTED_QK", False)}
FILE_TYPES = {
    T.F32: gguf.LlamaFileType.ALL_F32,
    T.F16: gguf.LlamaFileType.MOSTLY_F16,
    T.BF16: gguf.LlamaFileType.MOSTLY_BF16,
    T.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
    T.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
    T.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
    T.Q5_0: gguf.LlamaFileType.MOSTLY_Q5_0,
    T.Q5_1: gguf.LlamaFileType.MOSTLY_Q5_1,
    T.Q4_K: gguf.LlamaFileType.MOSTLY_Q4_K_M,
    T.Q5_K: gguf.LlamaFileType.MOSTLY_Q5_K_M,
    T.Q6_K: gguf.LlamaFileType.MOSTLY_Q6_K,
}
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}

# Every matmul's input dimension a whole number of 256-value K-quant super-blocks, also per
# rank at TP=2; head_dim = hidden / heads, as Qwen2's config (which has no head_dim) implies.
KQUANT_SHAPE = dict(
    hidden_size=512, num_heads=8, num_kv_heads=2, head_dim=64, intermediate_size=512
)

TypeChoice = T | Callable[[str, tuple[int, ...]], T]


def gguf_name(hf_name: str, model_type: str = "llama") -> str | None:
    own = getattr(ARCH_MODULES.get(model_type), "gguf_name", None)
    if own is not None:
        return own(hf_name)
    stem, suffix = hf_name.rsplit(".", 1)
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{suffix}"
    _, _, layer, part = stem.split(".", 3)
    names = LAYER_NAMES | getattr(ARCH_MODULES.get(model_type), "GGUF_LAYER_NAMES", {})
    stem = names[part]  # None: a tensor the family's converter leaves out
    return None if stem is None else f"blk.{layer}.{stem}.{suffix}"


def permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: rows of each head from rotate-half pairs
    (i, i + d/2) to adjacent pairs (2i, 2i + 1), llama.cpp's RoPE layout."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    shape = weights.shape
    return (
        weights.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:])
        .swapaxes(1, 2)
        .reshape(shape)
    )


def _rope_freqs(config: dict) -> np.ndarray:
    """LlamaModel.generate_extra_tensors' llama3 factors."""
    scaling = config["rope_scaling"]
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    base = config["rope_theta"]
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old = scaling.get("original_max_position_embeddings", 8192)
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _set_parameters(w: gguf.GGUFWriter, arch: str, config: dict, file_type: int) -> None:
    w.add_name(f"cpud fixture {config['model_type']}")
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    if config.get("num_key_value_heads") is not None:
        w.add_head_count_kv(config["num_key_value_heads"])
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaling["factor"])
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(scaling["factor"])
        w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    if config.get("rope_theta") is not None:
        w.add_rope_freq_base(config["rope_theta"])
    if config.get("rms_norm_eps") is not None:
        w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("layer_norm_eps") is not None:
        w.add_layer_norm_eps(config["layer_norm_eps"])
    if config.get("head_dim") is not None:
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])
    w.add_file_type(file_type)
    if arch == "llama":
        w.add_vocab_size(config["vocab_size"])
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        w.add_rope_dimension_count(head_dim)
    own = getattr(ARCH_MODULES.get(config["model_type"]), "gguf_parameters", None)
    if own is not None:
        own(w, config)


def _set_pooling_type(w: gguf.GGUFWriter, model_dir: Path) -> None:
    """convert_hf_to_gguf's _try_set_pooling_type (BertModel, Qwen2Model, Qwen3Model): the
    sentence-transformers Pooling module's mode, when the directory has one."""
    path = model_dir / "modules.json"
    if not path.is_file():
        return
    for module in json.loads(path.read_text()):
        if module["type"] == "sentence_transformers.models.Pooling":
            pooling = json.loads((model_dir / module["path"] / "config.json").read_text())
            if pooling["pooling_mode_mean_tokens"]:
                w.add_pooling_type(gguf.PoolingType.MEAN)
            elif pooling["pooling_mode_cls_token"]:
                w.add_pooling_type(gguf.PoolingType.CLS)
            elif pooling["pooling_mode_lasttoken"]:
                w.add_pooling_type(gguf.PoolingType.LAST)
            return


def encode(values: np.ndarray, qtype: T) -> np.ndarray:
    """values (float32) in qtype: float arrays for F32/F16, else [rows, bytes] of blocks; all-zero
    blocks for a type neither gguf nor tests/gguf_kquants.py writes (files cpud must refuse)."""
    if qtype in PACKERS:
        return quantize_k(values, qtype)
    try:
        return gguf.quants.quantize(values.astype(np.float32), qtype)
    except NotImplementedError:
        return np.zeros(gguf.quant_shape_to_byte_shape(values.shape, qtype), dtype=np.uint8)


def write_gguf(
    model_dir: Path,
    path: Path,
    tensor_type: TypeChoice = T.F32,
    *,
    tokenizer: str | None = None,
    skip: tuple[str, ...] = (),
) -> Path:
    """model_dir (a fixture) as one GGUF file; tensor_type: a type for every 2-D weight, or a
    function (GGUF name, shape) -> type. Tensors named in `skip` are left out. tokenizer: the
    kind of tokenizer metadata (gguf_vocab.py; default: the arch's GGUF_TOKENIZER, else gpt2)."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = GGUF_ARCH[config["model_type"]]
    choose = tensor_type if callable(tensor_type) else (lambda name, shape: tensor_type)
    writer = gguf.GGUFWriter(str(path), arch)
    file_type = FILE_TYPES.get(tensor_type, gguf.LlamaFileType.GUESSED)
    _set_parameters(writer, arch, config, file_type)
    _set_pooling_type(writer, model_dir)
    module = ARCH_MODULES.get(config["model_type"])
    kind = tokenizer or getattr(module, "GGUF_TOKENIZER", "gpt2")
    add_tokenizer_metadata(writer, model_dir, kind=kind)
    tensors = load_file(str(model_dir / "model.safetensors"))
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    # Gemma's converters store its "1 + w" norm weights as 1 + w
    norm_shift = getattr(ARCH_MODULES.get(config["model_type"]), "GGUF_NORM_SHIFT", 0.0)
    for hf, values in tensors.items():
        name = gguf_name(hf, config["model_type"])
        if name is None:  # a tensor the family's converter leaves out or folds elsewhere
            continue
        values = values.astype(np.float32)
        if norm_shift and hf.endswith("norm.weight"):
            values = values + np.float32(norm_shift)
        permuted = arch == "llama" or config["model_type"] in PERMUTED_QK
        if permuted and ".attn_q." in name:
            values = permute(values, heads, heads)
        elif permuted and ".attn_k." in name:
            values = permute(values, heads, kv_heads)
        if name in skip:
            continue
        # the converter keeps 1-D tensors and position / token type tables in F32
        f32 = values.ndim != 2 or name.startswith(("position_embd.", "token_types."))
        qtype = T.F32 if f32 else choose(name, values.shape)
        writer.add_tensor(name, encode(values, qtype), raw_dtype=qtype)
    kind = (config.get("rope_scaling") or {}).get("rope_type")
    if kind == "llama3" and "rope_freqs.weight" not in skip:
        writer.add_tensor("rope_freqs.weight", _rope_freqs(config), raw_dtype=T.F32)
    extra = getattr(ARCH_MODULES.get(config["model_type"]), "gguf_extra_tensors", None)
    for name, values in (extra(config) if extra is not None else {}).items():
        if name not in skip:  # top-level tensors of the family's converter (F32)
            writer.add_tensor(name, values.astype(np.float32), raw_dtype=T.F32)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def make_kquant_fixture(arch: str, out: Path) -> Path:
    """A fixture of arch in KQUANT_SHAPE (the tiny presets are 64 wide: too narrow for 256-value
    super-blocks)."""
    shape = replace(presets.TINY[arch], **KQUANT_SHAPE)
    with mock.patch.dict(presets.TINY, {arch: shape}):
        return make_model(arch, "tiny", out)
