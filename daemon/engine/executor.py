"""Where step plans run. tp=1 runs the model in this process; the multi-process daemon
provides an executor with the same two methods over ZeroMQ."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from cpud.config import EngineConfig
from cpud.protocol.control import RankStats
from cpud.protocol.step import StepPlan, StepResult

# The supervisor and the frontend import this module for planning: torch stays out of them.
if TYPE_CHECKING:
    from cpud.ranks.model_runner import RunnerConfig

log = logging.getLogger("cpud.executor")


class Executor(Protocol):
    def execute(self, plan: StepPlan) -> StepResult: ...

    def check_health(self) -> None:
        """Raise if the executor can no longer run steps (called while idle)."""
        ...

    def rank_stats(self) -> list[RankStats]:
        """The latest counters of every rank (for metrics)."""
        ...

    def shutdown(self) -> None: ...


def runner_config(config: EngineConfig) -> RunnerConfig:
    from cpud.engine.multiproc import rank_engine_config

    return rank_engine_config(config).runner_config()


class InProcessExecutor:
    def __init__(self, config: EngineConfig):
        import os

        from cpud.ranks.model_runner import ModelRunner
        from cpud.ranks.parallel import SingleRank
        from cpud.ranks.stats import RankStatsCollector

        self.runner = ModelRunner(runner_config(config), config.model, SingleRank())
        cpus = sorted(os.sched_getaffinity(0))
        self.stats = RankStatsCollector(0, None, cpus, 0)

    def execute(self, plan: StepPlan) -> StepResult:
        result = self.runner.execute(plan)
        assert result is not None, "a single rank always returns its result"
        self.stats.observe_step(result.forward_seconds)
        return result

    def check_health(self) -> None:
        return None

    def rank_stats(self) -> list[RankStats]:
        return [self.stats.snapshot(None, self.runner.kv_cache_bytes)]

    def shutdown(self) -> None:
        self.runner = None


def memory_plan(config: EngineConfig, plan: object, topology: object, **kv: float) -> object:
    """plan_memory for this configuration; `kv` sizes the cache (space in GiB or fraction)."""
    from cpud.placement.memory_plan import plan_memory

    return plan_memory(
        config.model,
        config.dtype,
        plan,
        topology,
        max_model_len=config.max_model_len,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        **kv,
    )


def check_memory(config: EngineConfig, plan: object, topology: object) -> None:
    """Refuse, with numbers, a configuration whose weights + KV cache do not fit a node."""
    memory = memory_plan(
        config, plan, topology, kv_cache_space_gib=config.kv_cache_bytes_per_rank / (1 << 30)
    )
    for line in memory.describe():
        log.info("memory: %s", line)


def size_kv_from_fraction(args: object, model_dir: object) -> object:
    """EngineArgs with the KV cache fraction (of each rank's available node memory) turned into
    an exact block count, so every process sizes the cache alike; unchanged without one, or
    when an explicit size (--kv-cache-space, VLLM_CPU_KVCACHE_SPACE, blocks) wins."""
    import dataclasses

    from cpud import envs
    from cpud.config import resolve_config
    from cpud.placement.binding import binding_spec, plan_binding
    from cpud.placement.topology import discover_topology

    explicit = args.kv_cache_space_gib or envs.kv_cache_space_gib() or args.num_kv_blocks
    if args.kv_cache_fraction is None:
        return args
    if explicit:
        log.warning("the KV cache fraction is ignored: an explicit KV cache size is set")
        return dataclasses.replace(args, kv_cache_fraction=None)
    config = resolve_config(dataclasses.replace(args, num_kv_blocks=1), model_dir)
    topology = discover_topology()
    plan = plan_binding(binding_spec(args.bind, args.reserved_cpus), config.tp, topology)
    memory = memory_plan(config, plan, topology, kv_cache_fraction=args.kv_cache_fraction)
    log.info(
        "KV cache: %.0f%% of available memory -> %d blocks per rank",
        100 * args.kv_cache_fraction,
        memory.num_kv_blocks,
    )
    return dataclasses.replace(args, kv_cache_fraction=None, num_kv_blocks=memory.num_kv_blocks)


def plan_placement(config: EngineConfig, bind: str | None, reserved_cpus: int | None):
    """The binding plan for config.tp ranks on this machine, after checking that weights and
    KV cache fit each rank's memory node (ConfigError with numbers otherwise)."""
    from cpud.placement.binding import binding_spec, plan_binding
    from cpud.placement.topology import discover_topology

    topology = discover_topology()
    plan = plan_binding(binding_spec(bind, reserved_cpus), config.tp, topology)
    check_memory(config, plan, topology)
    for line in plan.describe():
        log.info("binding: %s", line)
    return plan


def rank_slots(plan: object) -> list:
    from cpud.engine.rank_group import RankSlot

    return [RankSlot(list(r.cpus) or None, r.numa_node) for r in plan.ranks]


def make_executor(config: EngineConfig, bind: str | None, reserved_cpus: int | None) -> Executor:
    """In-process at tp=1; otherwise one bound rank process per shard, placed by the plan.
    Either way the memory plan is checked first."""
    plan = plan_placement(config, bind, reserved_cpus)
    if config.tp == 1:
        return InProcessExecutor(config)
    from cpud.engine.multiproc import MultiprocExecutor

    # The caller's torch thread count is its own: cpud's frontend sets 1 at its start, an
    # offline LLM(tp=2) leaves the user's process as it was (a TP=1 engine beside it keeps
    # its threads).
    return MultiprocExecutor(config, rank_slots(plan), config.collective)
