"""Shard and byte sizes that follow from the model config alone, without torch: the supervisor
and the frontend plan with them before any process imports torch; the ranks build with them."""

from __future__ import annotations

from typing import Any

from cpud.model.model_config import ModelConfig
from cpud.settings.errors import ConfigError

VOCAB_PADDING = 64
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# --kv-cache-dtype: bytes of one cached row (a token's keys or values of one kv head) of
# head_dim values; auto: the model's dtype (ranks/paged_kv.py has the formats)
KV_CACHE_DTYPES = ("auto", "bf16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
# the types whose rows end in a 4-byte fp32 scale (fp8 is fp8_e4m3, as vLLM names it)
SCALED_KV_CACHE_DTYPES = ("int8", "fp8", "fp8_e4m3")


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a dtype name ('bfloat16') or a torch.dtype."""
    itemsize = getattr(dtype, "itemsize", None)
    return itemsize if isinstance(itemsize, int) else DTYPE_BYTES[str(dtype)]


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ConfigError(
            f"{what} ({numerator}) is not divisible by the tensor-parallel size {denominator}: "
            f"choose a --tp that divides it"
        )
    return numerator // denominator


def vocab_shard_size(vocab_size: int, tp: int) -> int:
    padded = -(-vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    return -(-padded // tp)


def kv_heads_local(cfg: ModelConfig, tp: int) -> int:
    return max(1, cfg.num_kv_heads // tp)


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(
            f"--kv-cache-dtype {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}"
        )


def kv_row_bytes(head_dim: int, dtype: Any, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one cached row of head_dim values: the model dtype's (auto), bf16's, int8's or
    e4m3's (a byte each and their fp32 scale) or e5m2's (a byte each)."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype in SCALED_KV_CACHE_DTYPES:
        return head_dim + 4
    if kv_cache_dtype == "fp8_e5m2":
        return head_dim
    return head_dim * (2 if kv_cache_dtype == "bf16" else dtype_bytes(dtype))


def kv_block_bytes(
    cfg: ModelConfig, tp: int, block_size: int, dtype: Any, kv_cache_dtype: str = "auto"
) -> int:
    """Bytes one KV block takes on one rank, over all layers, keys and values."""
    per_token = (
        cfg.num_layers * kv_heads_local(cfg, tp) * kv_row_bytes(cfg.head_dim, dtype, kv_cache_dtype)
    )
    return 2 * block_size * per_token


def moe_extra_params(cfg: ModelConfig, tp: int) -> int:
    """Parameters one rank holds for the expert layers beyond a dense MLP of intermediate_size
    in their place: every expert's slice of gate/up/down (all experts, used or not) and the
    replicated router, less the dense MLP the plain count assumed. 0 for a dense model."""
    if not cfg.is_moe:
        return 0
    inter = divide(cfg.moe_intermediate_size, tp, "moe_intermediate_size")
    dense = divide(cfg.intermediate_size, tp, "intermediate_size")
    h = cfg.hidden_size
    shared = divide(cfg.shared_expert_intermediate_size, tp, "shared_expert_intermediate_size")
    per_layer = cfg.num_experts * 3 * h * inter + cfg.num_experts * h - 3 * h * dense
    per_layer += 3 * h * shared + h * bool(shared)  # the shared expert and its gate
    return per_layer * sum(cfg.moe_layer(i) for i in range(cfg.num_layers))


def moe_expert_params(cfg: ModelConfig, tp: int) -> int:
    """Parameters of every expert's gate/up/down on one rank (no router, no shared expert):
    what stays in the model dtype under a dense --quantization, which quantizes linears only."""
    if not cfg.is_moe:
        return 0
    inter = divide(cfg.moe_intermediate_size, tp, "moe_intermediate_size")
    layers = sum(cfg.moe_layer(i) for i in range(cfg.num_layers))
    return layers * cfg.num_experts * 3 * cfg.hidden_size * inter


def moe_activation_elems(cfg: ModelConfig, tp: int) -> int:
    """Scratch elements per token of an expert layer: each of the k (token, expert) rows
    gathered, its gate/up and activation, its fp32 output, and the router's scores."""
    if not cfg.is_moe:
        return 0
    inter = cfg.moe_intermediate_size // tp
    return cfg.num_experts_per_tok * (2 * cfg.hidden_size + 3 * inter) + cfg.num_experts
