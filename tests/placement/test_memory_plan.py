"""Weight shard counting against real parameter counts and built shards; the memory plan's
fit and no-fit decisions on fabricated nodes and cgroup limits."""

from __future__ import annotations

import math
import re

import pytest
import torch
from fake_sysfs import GiB, Machine, discover, write_cgroup_v2, write_machine

from cpud.fixtures.config import model_config
from cpud.fixtures.presets import resolve
from cpud.fixtures.weights import tensor_specs
from cpud.model.hf_config import parse_model_config
from cpud.model.sizes import kv_block_bytes
from cpud.placement.binding import binding_spec, plan_binding
from cpud.placement.memory_plan import (
    DEFAULT_KV_FRACTION,
    FRONTEND_BYTES,
    plan_memory,
    shard_param_count,
    weight_bytes,
)
from cpud.placement.topology import discover_topology
from cpud.ranks.models.build import build_model
from cpud.settings.errors import ConfigError

BF16 = torch.bfloat16
# two nodes with 12 GiB available each (10 free + 1 page cache + 1 reclaimable slab)
TWO_NODES = Machine(sockets=2, cores_per_node=4, mem_free_gib=10, file_gib=1, sreclaimable_gib=1)
ONE_NODE = Machine(cores_per_node=2, mem_free_gib=10, file_gib=1, sreclaimable_gib=1)


def preset_config(arch: str, preset: str, vocab: int = 512, **overrides):
    shape = resolve(arch, preset)
    raw = model_config(arch, shape, shape.vocab_size or vocab, "bfloat16", 1, 2, 0)
    return parse_model_config({**raw, **overrides})


QWEN3 = preset_config("qwen3", "qwen3-0.6b")
LLAMA = preset_config("llama", "llama-3.2-1b")


class MetaRank:
    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


def built_params(cfg, tp: int, rank: int) -> int:
    with torch.device("meta"):
        model = build_model(cfg, 64, torch.float32, MetaRank(rank, tp))
    return sum(p.numel() for p in model.parameters())


def test_published_parameter_counts():
    assert shard_param_count(QWEN3, 1) == 596_049_920
    assert shard_param_count(LLAMA, 1) == 1_235_814_400
    assert weight_bytes(QWEN3, BF16, 1) == 2 * 596_049_920
    assert weight_bytes(LLAMA, torch.float32, 2) == 4 * shard_param_count(LLAMA, 2)


ODD_LLAMA = {"tie_word_embeddings": False, "attention_bias": True, "vocab_size": 500}
PROJECTED_OPT = {"word_embed_proj_dim": 32, "do_layer_norm_before": False}
SHARDED = [
    ("qwen3-0.6b", QWEN3),
    ("llama-3.2-1b", LLAMA),
    *[
        (arch, preset_config(arch, "tiny"))
        for arch in ("llama", "mistral", "qwen2", "qwen3", "opt")
    ],
    # vocab not a multiple of 64, untied head, qkv bias
    ("llama-odd", preset_config("llama", "tiny", **ODD_LLAMA)),
    # OPT with a projected embedding, post-LN and an untied head
    ("opt-proj", preset_config("opt", "tiny", tie_word_embeddings=False, **PROJECTED_OPT)),
]


@pytest.mark.parametrize(("name", "cfg"), SHARDED, ids=[name for name, _ in SHARDED])
def test_shard_counts_match_built_rank_shards(name, cfg):
    # tp=4 on tiny llama/mistral/qwen3 (2 KV heads) replicates KV heads
    for tp in (1, 2, 4):
        expected = shard_param_count(cfg, tp)
        assert built_params(cfg, tp, 0) == expected, (name, tp)
        assert built_params(cfg, tp, tp - 1) == expected, (name, tp)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "opt"])
def test_tp1_count_matches_checkpoint_tensors(arch):
    shape = resolve(arch, "tiny")
    total = sum(math.prod(spec.shape) for spec in tensor_specs(arch, shape, 512, 500))
    assert shard_param_count(preset_config(arch, "tiny"), 1) == total


def test_indivisible_heads_are_refused_early():
    with pytest.raises(ConfigError, match="num_attention_heads .16. is not divisible by"):
        shard_param_count(QWEN3, 3)


# --- the plan ------------------------------------------------------------------------------


def setup(tmp_path, machine, tp, bind=None, allowed=None):
    topo = discover(tmp_path, machine, allowed=allowed)
    return plan_binding(binding_spec(bind, env={}), tp, topo), topo


def error(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as err:
        fn(*args, **kwargs)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_default_fraction_fits(tmp_path):
    binding, topo = setup(tmp_path, TWO_NODES, tp=2)
    mem = plan_memory(QWEN3, BF16, binding, topo, max_model_len=4096)
    assert mem.kv_source == "fraction"
    block = kv_block_bytes(QWEN3, 2, 16, BF16)
    first = mem.ranks[0]
    assert first.budget_bytes == 12 * GiB and first.budget_source.startswith("NUMA node 0")
    room = 12 * GiB - first.weight_bytes - first.overhead_bytes
    assert mem.num_kv_blocks == int(room * DEFAULT_KV_FRACTION) // block
    assert all(r.kv_bytes == mem.num_kv_blocks * block for r in mem.ranks)
    assert first.weight_bytes == 2 * shard_param_count(QWEN3, 2)
    assert [r.numa_node for r in mem.ranks] == [0, 1]
    assert first.total_bytes <= first.budget_bytes
    assert mem.kv_tokens == mem.num_kv_blocks * 16
    assert mem.describe()[0].startswith("rank 0: weights 0.56 GiB + KV cache")


def test_ranks_sharing_a_node_split_its_memory(tmp_path):
    binding, topo = setup(tmp_path, ONE_NODE, tp=2)
    mem = plan_memory(QWEN3, BF16, binding, topo, max_model_len=4096)
    assert [r.budget_bytes for r in mem.ranks] == [6 * GiB, 6 * GiB]
    assert "shared by 2 ranks" in mem.ranks[0].budget_source


def test_explicit_kv_space(tmp_path):
    binding, topo = setup(tmp_path, TWO_NODES, tp=2)
    mem = plan_memory(QWEN3, BF16, binding, topo, max_model_len=4096, kv_cache_space_gib=2)
    assert mem.kv_source == "explicit"
    assert mem.num_kv_blocks == 2 * GiB // kv_block_bytes(QWEN3, 2, 16, BF16)


def test_explicit_kv_space_does_not_fit(tmp_path):
    binding, topo = setup(tmp_path, ONE_NODE, tp=2)
    kwargs = {"max_model_len": 4096}
    message = error(plan_memory, QWEN3, BF16, binding, topo, kv_cache_space_gib=8, **kwargs)
    match = re.fullmatch(
        r"rank 0 on NUMA node 0 needs 0\.56 GiB weights \+ 8\.00 GiB KV cache \+ "
        r"(\d+\.\d\d) GiB runtime = (\d+\.\d\d) GiB, but has 6\.00 GiB \(NUMA node 0: 12\.00 GiB "
        r"available, shared by 2 ranks\): lower --kv-cache-space to (\d+\.\d\d) GiB or less "
        r"\(that holds (\d+) tokens: max_model_len up to (\d+)\)",
        message,
    )
    assert match, message
    largest, tokens = float(match[3]), int(match[4])
    # the suggestion is right at the edge: it fits, one hundredth of a GiB more does not
    mem = plan_memory(QWEN3, BF16, binding, topo, kv_cache_space_gib=largest, **kwargs)
    assert mem.kv_tokens == tokens
    with pytest.raises(ConfigError):
        plan_memory(QWEN3, BF16, binding, topo, kv_cache_space_gib=largest + 0.01, **kwargs)


def test_weights_alone_do_not_fit(tmp_path):
    tiny_node = Machine(cores_per_node=2, mem_free_gib=2, file_gib=0, sreclaimable_gib=0)
    binding, topo = setup(tmp_path, tiny_node, tp=1)
    message = error(plan_memory, LLAMA, torch.float32, binding, topo, max_model_len=4096)
    assert message.startswith("rank 0 on NUMA node 0 needs 4.60 GiB for its weight shard + ")
    assert "but has 2.00 GiB (NUMA node 0: 2.00 GiB available): free memory" in message
    assert "raise --tp" in message


def test_kv_too_small_for_max_model_len(tmp_path):
    binding, topo = setup(tmp_path, TWO_NODES, tp=2)
    kwargs = {"max_model_len": 32768}
    message = error(plan_memory, QWEN3, BF16, binding, topo, kv_cache_space_gib=0.5, **kwargs)
    match = re.fullmatch(
        r"KV cache of 0\.50 GiB per rank holds (\d+) tokens, fewer than max_model_len 32768: "
        r"raise --kv-cache-space to (\d+\.\d\d) GiB or lower --max-model-len to (\d+)",
        message,
    )
    assert match, message
    assert match[1] == match[3] == str(GiB // 2 // kv_block_bytes(QWEN3, 2, 16, BF16) * 16)
    mem = plan_memory(QWEN3, BF16, binding, topo, kv_cache_space_gib=float(match[2]), **kwargs)
    assert mem.kv_tokens >= 32768
    shorter = int(match[3])
    mem = plan_memory(QWEN3, BF16, binding, topo, max_model_len=shorter, kv_cache_space_gib=0.5)
    assert mem.kv_tokens >= shorter


def test_fraction_too_small_for_max_model_len(tmp_path):
    small = Machine(cores_per_node=2, mem_free_gib=8, file_gib=0, sreclaimable_gib=0)
    binding, topo = setup(tmp_path, small, tp=1)
    message = error(plan_memory, QWEN3, BF16, binding, topo, max_model_len=40960)
    assert message.startswith("KV cache of 0.5 x the ")
    assert "fewer than max_model_len 40960: raise --kv-cache-fraction to" in message
    too_big = error(plan_memory, QWEN3, BF16, binding, topo, max_model_len=40960 * 4)
    assert "lower --max-model-len to" in too_big and "or free memory" in too_big


def test_cgroup_memory_max_limits_every_rank(tmp_path):
    sys_root, proc_root = write_machine(tmp_path, TWO_NODES)
    write_cgroup_v2(sys_root, proc_root, "/cpud", {"/cpud": {"memory.max": str(6 * GiB)}})
    topo = discover_topology(sys_root, proc_root=proc_root, allowed_cpus=TWO_NODES.cpus)
    binding = plan_binding(binding_spec(env={}), 2, topo)
    mem = plan_memory(QWEN3, BF16, binding, topo, max_model_len=4096)
    assert [r.budget_bytes for r in mem.ranks] == [(6 * GiB - FRONTEND_BYTES) // 2] * 2
    assert mem.ranks[0].budget_source.startswith("cgroup limit 6.00 GiB, 6.00 GiB free")
    kwargs = {"max_model_len": 4096, "kv_cache_space_gib": 4}
    message = error(plan_memory, QWEN3, BF16, binding, topo, **kwargs)
    assert "but has 2.75 GiB (cgroup limit 6.00 GiB" in message


def test_gpu_memory_utilization_alias(tmp_path):
    binding, topo = setup(tmp_path, TWO_NODES, tp=2)
    default = plan_memory(QWEN3, BF16, binding, topo, max_model_len=4096)
    alias = plan_memory(QWEN3, BF16, binding, topo, max_model_len=4096, gpu_memory_utilization=0.9)
    assert alias.num_kv_blocks > default.num_kv_blocks
    assert any("on CPU it is the share of host RAM" in w for w in alias.warnings)
    same = plan_memory(QWEN3, BF16, binding, topo, max_model_len=4096, kv_cache_fraction=0.9)
    assert same.num_kv_blocks == alias.num_kv_blocks and same.warnings == ()
    both = {"kv_cache_fraction": 0.5, "gpu_memory_utilization": 0.5}
    assert "give one" in error(plan_memory, QWEN3, BF16, binding, topo, max_model_len=64, **both)
    for bad in (0, 1.5, -0.1):
        kwargs = {"max_model_len": 64, "gpu_memory_utilization": bad}
        message = error(plan_memory, QWEN3, BF16, binding, topo, **kwargs)
        assert message.startswith("--gpu-memory-utilization must be in (0, 1]")


def test_explicit_space_wins_over_fraction(tmp_path):
    binding, topo = setup(tmp_path, TWO_NODES, tp=2)
    kwargs = {"max_model_len": 4096, "kv_cache_space_gib": 1, "kv_cache_fraction": 0.9}
    mem = plan_memory(QWEN3, BF16, binding, topo, **kwargs)
    assert mem.kv_source == "explicit"
    assert any("fraction is ignored" in w for w in mem.warnings)


def test_nobind_budget_spans_all_nodes(tmp_path):
    binding, topo = setup(tmp_path, TWO_NODES, tp=2, bind="nobind")
    mem = plan_memory(QWEN3, BF16, binding, topo, max_model_len=4096)
    assert [r.budget_bytes for r in mem.ranks] == [12 * GiB, 12 * GiB]
    assert mem.ranks[0].numa_node is None


def test_kv_capped_at_what_sequences_can_use(tmp_path):
    binding, topo = setup(tmp_path, TWO_NODES, tp=2)
    mem = plan_memory(QWEN3, BF16, binding, topo, max_model_len=1024, max_num_seqs=2)
    assert mem.num_kv_blocks == 2 * 1024 // 16
    assert any("capped at 128 blocks" in n for n in mem.notes)
