"""The memory plan sizes the KV cache by --kv-cache-dtype's bytes per token: an int8 or fp8
cache holds about twice the blocks of a bf16 one in the same room, and says so."""

from __future__ import annotations

import pytest
from test_memory_plan import BF16, ONE_NODE, QWEN3, setup

from cpud.model.sizes import kv_block_bytes
from cpud.placement.memory_plan import plan_memory
from cpud.settings.errors import ConfigError


def test_quantized_caches_get_more_blocks_in_the_same_room(tmp_path):
    binding, topo = setup(tmp_path, ONE_NODE, tp=1)
    plans = {
        kv: plan_memory(QWEN3, BF16, binding, topo, max_model_len=4096, kv_cache_dtype=kv)
        for kv in ("auto", "bf16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
    }
    assert plans["bf16"].num_kv_blocks == plans["auto"].num_kv_blocks
    hd = QWEN3.head_dim
    for scaled in ("int8", "fp8", "fp8_e4m3"):  # a byte per value and an fp32 scale per row
        ratio = plans[scaled].num_kv_blocks / plans["auto"].num_kv_blocks
        assert ratio == pytest.approx(2 * hd / (hd + 4), rel=1e-3)
    assert plans["fp8_e5m2"].num_kv_blocks == pytest.approx(2 * plans["auto"].num_kv_blocks, 1e-3)
    int8 = plans["int8"]
    assert int8.kv_block_bytes == kv_block_bytes(QWEN3, 1, 16, BF16, "int8")
    assert int8.ranks[0].kv_bytes == int8.num_kv_blocks * int8.kv_block_bytes
    line = next(x for x in int8.describe() if x.startswith("KV cache:"))
    per_token = 2 * QWEN3.num_layers * QWEN3.num_kv_heads * (hd + 4)
    assert f"int8, {per_token} bytes per token" in line


def test_explicit_space_holds_more_tokens_int8(tmp_path):
    binding, topo = setup(tmp_path, ONE_NODE, tp=1)
    bf16 = plan_memory(QWEN3, BF16, binding, topo, max_model_len=4096, kv_cache_space_gib=1)
    int8 = plan_memory(
        QWEN3, BF16, binding, topo, max_model_len=4096, kv_cache_space_gib=1, kv_cache_dtype="int8"
    )
    assert int8.kv_tokens > 1.8 * bf16.kv_tokens


def test_unknown_kv_cache_dtype_is_refused(tmp_path):
    binding, topo = setup(tmp_path, ONE_NODE, tp=1)
    with pytest.raises(ConfigError, match="--kv-cache-dtype 'q4_0'.*fp8, fp8_e4m3, fp8_e5m2"):
        plan_memory(QWEN3, BF16, binding, topo, max_model_len=4096, kv_cache_dtype="q4_0")
