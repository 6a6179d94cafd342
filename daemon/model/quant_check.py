"""--quantization values and what they mean for a model, without torch: the supervisor and the
frontend check the flag and size the weights before any rank starts."""

from __future__ import annotations

from pathlib import Path

from cpud.model.model_config import ModelConfig
from cpud.native.quant_formats import FLOAT_TYPES, KERNEL_FORMATS
from cpud.ranks.models import registry
from cpud.settings import choices
from cpud.settings.errors import ConfigError

# --quantization value -> GGUF type name of the linears (ranks/quantize_dense.py)
DENSE_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k": "Q4_K"}
QUANTIZATION_CHOICES = choices("quantization")  # auto, none and the DENSE_TYPES keys
HEAD_TYPE = "Q8_0"  # the LM head and the embedding table under a dense quantization
# GGUF type the native GEMM runs in its blocks: (values per block, bytes per block)
BLOCKS = {name: (f.block_values, f.block_bytes) for name, f in KERNEL_FORMATS.items()}


def linear_ks(cfg: ModelConfig, tp: int) -> list[tuple[str, int]]:
    """(checkpoint tensor, K per rank) of each kind of linear, layer 0 standing for all."""
    own = registry.by_name(cfg.family).linear_ks
    if own is not None:
        return own(cfg, tp)
    h, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim // tp
    first = "model.layers.0"
    return [
        (f"{first}.self_attn.q_proj.weight", h),
        (f"{first}.self_attn.o_proj.weight", q),
        (f"{first}.mlp.gate_proj.weight", h),
        (f"{first}.mlp.down_proj.weight", cfg.intermediate_size // tp),
    ]


def check_quantization(cfg: ModelConfig, quantization: str, tp: int) -> None:
    """ConfigError (one line) for a --quantization value that cannot apply to this model."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ConfigError(
            f"--quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {quantization!r}"
        )
    if quantization not in DENSE_TYPES:
        return
    qtype = DENSE_TYPES[quantization]
    checks = [(name, k, qtype) for name, k in linear_ks(cfg, tp)]
    checks.append(("lm_head.weight", cfg.hidden_size, HEAD_TYPE))
    for name, k, kind in checks:
        block = BLOCKS[kind][0]
        if k % block:
            hint = "q8_0 or q4_0" if block > 32 else "none"
            raise ConfigError(
                f"--quantization {quantization}: {name} has {k} input columns per rank, not a "
                f"multiple of {kind}'s {block}-value blocks; use --quantization {hint}"
            )


def check_runs_quantized(quantization: str, kernels: str, dtype: str) -> None:
    """A dense checkpoint quantized at load needs the int8 kernels: native, bf16 or fp32."""
    if quantization not in DENSE_TYPES:
        return
    if kernels == "torch" or dtype not in ("bfloat16", "float32"):
        raise ConfigError(
            f"--quantization {quantization} runs on the native int8 kernels in bfloat16 or "
            f"float32, not --kernels {kernels} --dtype {dtype}"
        )


def check_gguf_dense(path: str | Path, quantization: str) -> None:
    """A GGUF file quantized already is not quantized again: ConfigError naming a tensor."""
    if quantization not in DENSE_TYPES:
        return
    from cpud.model.gguf_model import read_gguf_model

    for name, info in read_gguf_model(path).tensors.items():
        if len(info.shape) == 2 and info.type not in FLOAT_TYPES:
            raise ConfigError(
                f"--quantization {quantization}: {path} is quantized already ({name} is "
                f"{info.type}); use --quantization auto to run its blocks"
            )


def quantized_bytes(elements: int, qtype: str) -> int:
    """Bytes of `elements` values in GGUF blocks of `qtype`."""
    block, size = BLOCKS[qtype]
    return -(-elements // block) * size
