"""An encoder-only model (BERT) in the memory plan: its weight shard counted as the ranks build
it, and no KV cache: the plan never refuses it for lack of KV room and gives it no KV bytes."""

from __future__ import annotations

import pytest
import torch
from fake_sysfs import GiB, Machine, discover

from cpud.fixtures.config import model_config
from cpud.fixtures.presets import resolve
from cpud.model.hf_config import parse_model_config
from cpud.placement.binding import binding_spec, plan_binding
from cpud.placement.memory_plan import overhead_bytes, plan_memory, shard_param_count
from cpud.ranks.models.build import build_model
from cpud.settings.errors import ConfigError

# little memory: 1 GiB free on one node
SMALL = Machine(cores_per_node=2, mem_total_gib=2, mem_free_gib=1, file_gib=0, sreclaimable_gib=0)


def bert_config(**overrides):
    raw = model_config("bert", resolve("bert", "tiny"), 576, "float32", 2, 3, 0)
    return parse_model_config({**raw, **overrides})


class MetaRank:
    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_count_matches_the_built_encoder(tp):
    cfg = bert_config(vocab_size=500)  # a vocabulary padded per rank
    for rank in (0, tp - 1):
        with torch.device("meta"):
            model = build_model(cfg, 64, torch.float32, MetaRank(rank, tp))
        assert sum(p.numel() for p in model.parameters()) == shard_param_count(cfg, tp)


def test_no_kv_cache_for_an_encoder(tmp_path):
    cfg = bert_config(max_position_embeddings=4096, hidden_size=1024, num_attention_heads=16)
    topo = discover(tmp_path, SMALL)
    binding = plan_binding(binding_spec(None, env={}), 1, topo)
    # a decoder of this shape with the room it has left could not hold the KV of 4096 tokens
    for space in (None, 0.001):
        mem = plan_memory(
            cfg, "float32", binding, topo, max_model_len=4096, kv_cache_space_gib=space
        )
        assert mem.ranks[0].kv_bytes == 0
        assert mem.num_kv_blocks == 4096 // 16 * 256  # every sequence at full length
    assert mem.ranks[0].total_bytes < 1 * GiB
    # no logits buffer: the vocabulary does not size the runtime
    wider = bert_config(vocab_size=50_000)
    assert overhead_bytes(wider, "float32", 1, 512, 8192, 64) == overhead_bytes(
        bert_config(), "float32", 1, 512, 8192, 64
    )


def test_an_encoder_that_does_not_fit_is_refused(tmp_path):
    cfg = bert_config(hidden_size=4096, num_attention_heads=32, intermediate_size=16384)
    topo = discover(tmp_path, SMALL)
    binding = plan_binding(binding_spec(None, env={}), 1, topo)
    with pytest.raises(ConfigError, match="before any KV cache"):
        plan_memory(cfg, "float32", binding, topo, max_model_len=512)
