"""The one planning entry of a start: settings resolved, then topology -> binding -> memory ->
rank slots, each computed once. The supervisor, the offline `LLM` and `cpud doctor` all plan
through these steps (doctor runs them one by one to report each failure on its own).

A KV cache fraction (of each rank's available node memory) is turned into an exact block
count here, so every process sizes the cache alike.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

from cpud.placement.binding import BindingPlan, binding_spec, plan_binding
from cpud.placement.memory_plan import MemoryPlan, plan_memory
from cpud.placement.topology import Topology, discover_topology
from cpud.protocol.launch import RankSlot
from cpud.settings import envs
from cpud.settings.config import EngineArgs, EngineConfig, resolve_config

log = logging.getLogger("cpud.placement")
GiB = 1 << 30


@dataclass(frozen=True)
class StartPlan:
    config: EngineConfig  # the KV cache as an exact block count
    topology: Topology
    binding: BindingPlan
    memory: MemoryPlan

    @property
    def slots(self) -> list[RankSlot]:
        """Where each rank runs, in rank order."""
        return [RankSlot(list(r.cpus) or None, r.numa_node) for r in self.binding.ranks]


def kv_fraction(args: EngineArgs) -> float | None:
    """The KV cache fraction that sizes the cache: None without one, or when an explicit size
    (--kv-cache-space, VLLM_CPU_KVCACHE_SPACE, blocks) wins."""
    if args.kv_cache_fraction is None:
        return None
    if args.kv_cache_space_gib or envs.kv_cache_space_gib() or args.num_kv_blocks:
        log.warning("the KV cache fraction is ignored: an explicit KV cache size is set")
        return None
    return args.kv_cache_fraction


def resolve_engine(args: EngineArgs, model_dir: Path, fraction: float | None) -> EngineConfig:
    """The resolved config; with a fraction, one block stands in until size_kv_cache."""
    if fraction is not None:
        args = dataclasses.replace(args, kv_cache_fraction=None, num_kv_blocks=1)
    return resolve_config(args, model_dir)


def bind_ranks(args: EngineArgs, tp: int, topology: Topology) -> BindingPlan:
    return plan_binding(binding_spec(args.bind, args.reserved_cpus), tp, topology)


def config_memory(
    config: EngineConfig,
    binding: BindingPlan,
    topology: Topology,
    *,
    max_model_len: int | None = None,
    kv_cache_space_gib: float | None = None,
    kv_cache_fraction: float | None = None,
) -> MemoryPlan:
    """plan_memory for this config; the KV cache sized by space (GiB) or fraction."""
    return plan_memory(
        config.model,
        config.dtype,
        binding,
        topology,
        max_model_len=max_model_len or config.max_model_len,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        kv_cache_space_gib=kv_cache_space_gib,
        kv_cache_fraction=kv_cache_fraction,
        weights=config.weight_bytes_per_rank,
        kv_cache_dtype=config.kv_cache_dtype,
        draft_block_bytes=config.draft_kv_block_bytes,
    )


def size_kv_cache(
    config: EngineConfig, fraction: float, binding: BindingPlan, topology: Topology
) -> EngineConfig:
    """The config with the fraction turned into an exact block count per rank."""
    memory = config_memory(config, binding, topology, kv_cache_fraction=fraction)
    log.info(
        "KV cache: %.0f%% of available memory -> %d blocks per rank",
        100 * fraction,
        memory.num_kv_blocks,
    )
    return dataclasses.replace(config, num_kv_blocks=memory.num_kv_blocks)


def check_memory(config: EngineConfig, binding: BindingPlan, topology: Topology) -> MemoryPlan:
    """The memory plan of the config's KV cache; ConfigError with numbers where weights and
    KV cache do not fit a node."""
    space = config.kv_cache_bytes_per_rank / GiB
    return config_memory(config, binding, topology, kv_cache_space_gib=space)


def plan_start(
    args: EngineArgs,
    model_dir: Path,
    topology: Topology | None = None,
    binding: BindingPlan | None = None,
) -> StartPlan:
    """Everything a start needs before any process is spawned; ConfigError where the settings,
    the model or the machine refuse. `binding`: the ranks' places where planned already (a
    data-parallel replica's share of the host)."""
    fraction = kv_fraction(args)
    config = resolve_engine(args, model_dir, fraction)
    topology = topology or discover_topology()
    binding = binding or bind_ranks(args, config.tp, topology)
    if fraction is not None:
        config = size_kv_cache(config, fraction, binding, topology)
    memory = check_memory(config, binding, topology)
    for line in memory.describe():
        log.info("memory: %s", line)
    for line in binding.describe():
        log.info("binding: %s", line)
    return StartPlan(config, topology, binding, memory)
