"""The plans `cpud serve` would make with the given settings, made the same way and kept
together with the reason wherever a step refuses (several checks read the same plans).

The steps are those of cpud.placement.start.plan_start, the supervisor's planning entry, run
one by one: topology, binding spec and plan, the resolved engine config (a KV cache fraction
sized into blocks), then the memory plan with the config's KV cache size per rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from cpud.doctor.inputs import DoctorInputs
from cpud.model.sizes import kv_block_bytes
from cpud.placement.binding import BindingPlan, BindingSpec, binding_spec, plan_binding
from cpud.placement.cgroup import CgroupCpuset, read_cpuset
from cpud.placement.memory_plan import FRONTEND_BYTES, MemoryPlan, overhead_bytes
from cpud.placement.replicas import ReplicaPlacement, ReplicaPlan, plan_replicas
from cpud.placement.start import (
    check_memory,
    config_memory,
    kv_fraction,
    resolve_engine,
    size_kv_cache,
)
from cpud.placement.topology import Topology, discover_topology
from cpud.settings.config import EngineConfig
from cpud.settings.errors import CpudError

GiB = 1 << 30
T = TypeVar("T")


@dataclass(frozen=True)
class Failed:
    reason: str
    # True: not attempted because a step it needs failed (the reason names that step)
    upstream: bool = False


@dataclass(frozen=True)
class Headroom:
    """The most KV cache the tightest rank could hold next to its weights and runtime."""

    kv_bytes: int
    # kv_bytes rounded down to a --kv-cache-space value that still fits
    kv_gib: float
    kv_tokens: int
    # the longest context one sequence could use: kv_tokens, capped by the model
    max_model_len: int


@dataclass(frozen=True)
class Planning:
    affinity: frozenset[int] | Failed
    cpuset: CgroupCpuset | None
    topology: Topology | Failed
    spec: BindingSpec | Failed
    binding: BindingPlan | Failed
    config: EngineConfig | Failed
    memory: MemoryPlan | Failed
    headroom: Headroom | None
    # what the whole plan holds under one cgroup: every rank plus the frontend (of each replica)
    need_bytes: int | None
    # --data-parallel-size above 1: every replica's place and memory plan (binding, memory and
    # headroom above are then replica 0's)
    replicas: ReplicaPlan | Failed | None = None
    replica_memory: tuple[MemoryPlan | Failed, ...] = ()


def _attempt(step: Callable[[], T]) -> T | Failed:
    try:
        return step()
    except CpudError as exc:
        return Failed(str(exc))
    except Exception as exc:  # a diagnostic reports a broken step instead of crashing
        return Failed(f"unexpected {type(exc).__name__}: {exc}")


def _upstream(**steps: object) -> Failed | None:
    for name, step in steps.items():
        if isinstance(step, Failed):
            return Failed(f"no {name}: {step.reason}", upstream=True)
    return None


def allowed_cpus(affinity: frozenset[int], cpuset: CgroupCpuset | None) -> frozenset[int]:
    """The affinity mask within the cgroup's cpuset. On Linux the mask already lies inside
    the cpuset; a cpuset read from the wrong cgroup (no overlap) is ignored."""
    if cpuset is None:
        return affinity
    return (affinity & frozenset(cpuset.cpus)) or affinity


def _per_rank_bytes(config: EngineConfig) -> tuple[int, int]:
    """(weights + runtime, KV cache) of one rank as the memory planner counts them."""
    weights = config.weight_bytes_per_rank
    runtime = overhead_bytes(
        config.model,
        config.dtype,
        config.tp,
        config.max_model_len,
        config.max_num_batched_tokens,
        config.max_num_seqs,
    )
    return weights + runtime, config.kv_cache_bytes_per_rank


def headroom(config: EngineConfig, binding: BindingPlan, topology: Topology) -> Headroom:
    """Largest KV cache per rank that fits, whatever --kv-cache-space asks for.

    A one-block context with the KV fraction at 1 always plans when anything fits; its rank
    budgets less weights and the runtime at the real context length leave the KV room.
    """
    block_bytes = kv_block_bytes(
        config.model, config.tp, config.block_size, config.dtype, config.kv_cache_dtype
    )
    probe = _attempt(
        lambda: config_memory(
            config, binding, topology, max_model_len=config.block_size, kv_cache_fraction=1.0
        )
    )
    fixed, _ = _per_rank_bytes(config)
    if isinstance(probe, Failed):
        room = 0
    else:
        room = max(0, min(rank.budget_bytes for rank in probe.ranks) - fixed)
    kv_gib = math.floor(room / GiB * 100) / 100
    tokens = int(kv_gib * GiB) // block_bytes * config.block_size
    return Headroom(room, kv_gib, tokens, min(tokens, config.model.max_position_embeddings))


def plan(inputs: DoctorInputs) -> Planning:
    from cpud.model.model_dir import resolve_model_dir

    args = inputs.engine
    affinity = _attempt(inputs.syscalls.affinity)
    cpuset = read_cpuset(inputs.cgroup_dir, inputs.proc_root)
    allowed = None if isinstance(affinity, Failed) else allowed_cpus(affinity, cpuset)
    topology = _attempt(
        lambda: discover_topology(
            inputs.sysfs_root,
            proc_root=inputs.proc_root,
            cgroup_root=inputs.cgroup_dir,
            allowed_cpus=allowed,
        )
    )
    spec = _attempt(lambda: binding_spec(args.bind, args.reserved_cpus))
    dp = inputs.data_parallel_size
    replicas: ReplicaPlan | Failed | None = None
    topology_view = topology  # what replica 0 may use, with several
    if isinstance(spec, Failed):
        binding: BindingPlan | Failed = spec
    elif dp != 1:
        replicas = _upstream(topology=topology) or _attempt(
            lambda: plan_replicas(args.bind, args.reserved_cpus, args.tp, dp, topology)
        )
        if isinstance(replicas, Failed):
            binding = replicas
        else:
            binding, topology_view = replicas.replicas[0].binding, replicas.replicas[0].topology
    else:
        binding = _upstream(topology=topology) or _attempt(
            lambda: plan_binding(spec, args.tp, topology)
        )
    fraction = kv_fraction(args)
    unsized = _attempt(lambda: resolve_engine(args, resolve_model_dir(args.model), fraction))
    config = unsized
    if fraction is not None and not isinstance(config, Failed):
        config = _upstream(binding=binding) or _attempt(
            lambda: size_kv_cache(unsized, fraction, binding, topology_view)
        )

    need = None
    if not isinstance(config, Failed):
        fixed, kv = _per_rank_bytes(config)
        need = max(dp, 1) * (config.tp * (fixed + kv) + FRONTEND_BYTES)
    memory = _upstream(binding=binding, config=config) or _attempt(
        lambda: check_memory(config, binding, topology_view)
    )
    fits = None
    if not isinstance(memory, Failed) or not memory.upstream:
        fits = headroom(config, binding, topology_view)
    replica_memory: tuple[MemoryPlan | Failed, ...] = ()
    if replicas is not None and not isinstance(replicas, Failed):
        replica_memory = tuple(
            _upstream(config=unsized) or _attempt(lambda r=r: _replica_memory(unsized, fraction, r))
            for r in replicas.replicas
        )
    return Planning(
        affinity,
        cpuset,
        topology,
        spec,
        binding,
        config,
        memory,
        fits,
        need,
        replicas,
        replica_memory,
    )


def _replica_memory(
    config: EngineConfig, fraction: float | None, replica: ReplicaPlacement
) -> MemoryPlan:
    """One replica's memory plan, its KV cache sized on its own share as the replica does."""
    if fraction is not None:
        config = size_kv_cache(config, fraction, replica.binding, replica.topology)
    return check_memory(config, replica.binding, replica.topology)
