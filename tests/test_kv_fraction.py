"""--kv-cache-fraction / vLLM's --gpu-memory-utilization: the KV cache as a share of each rank's
available node memory, resolved once into a block count."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cpud import LLM
from cpud.placement.topology import discover_topology
from cpud.settings.errors import ConfigError


def test_fraction_sizes_the_cache_from_available_memory(model_factory, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    model_dir = model_factory("llama")
    small = LLM(model_dir, dtype="float32", kv_cache_fraction=0.001, max_num_seqs=100000)
    large = LLM(model_dir, dtype="float32", kv_cache_fraction=0.002, max_num_seqs=100000)
    available = sum(n.mem_available for n in discover_topology().nodes)
    small_bytes = small.config.kv_cache_bytes_per_rank
    # About 0.1 % of what is free after weights and runtime (free memory moves a little).
    assert 0.0005 * available < small_bytes < 0.0011 * available
    assert 1.7 < large.config.kv_cache_bytes_per_rank / small_bytes < 2.3


def test_explicit_space_wins_over_the_fraction(model_factory):
    llm = LLM(
        model_factory("llama"), dtype="float32", kv_cache_space_gib=0.01, kv_cache_fraction=0.5
    )
    assert llm.config.kv_cache_bytes_per_rank <= 0.01 * (1 << 30)


def test_fraction_out_of_range_is_a_config_error(model_factory):
    with pytest.raises(ConfigError, match=r"must be in \(0, 1\]"):
        LLM(model_factory("llama"), dtype="float32", kv_cache_fraction=1.5)


def test_gpu_memory_utilization_is_accepted_with_a_cpu_warning(model_factory):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "cpud.cli",
            "generate",
            "--model",
            str(model_factory("llama")),
            "--dtype",
            "float32",
            "--gpu-memory-utilization",
            "0.001",
            "--max-tokens",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "--gpu-memory-utilization is read as --kv-cache-fraction" in run.stderr
    assert "host RAM" in run.stderr
    assert json.loads(run.stdout)["outputs"][0]["token_ids"]
