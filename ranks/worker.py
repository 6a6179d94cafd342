"""One rank process: bind, pin, load its weight shard, then execute step plans in lockstep.

    python -m cpud.ranks.worker SPEC_JSON

The spec (a RankSpec, msgspec JSON) says where to run and how to reach the frontend. Rank 0
returns each step's sampled tokens; every rank reports READY once loaded, or FAILED.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from pathlib import Path

import msgspec

from cpud.ranks.binding import bind_memory, die_with_parent, pin_threads, set_affinity

log = logging.getLogger("cpud.rank")
LOAD_BARRIER_TIMEOUT_S = 1800.0


class RankSpec(msgspec.Struct, frozen=True):
    rank: int
    world_size: int
    runtime_dir: str
    cpus: list[int] | None  # None: no binding (nobind)
    numa_node: int | None
    collective: str  # "shm" | "gloo"
    engine_config_json: str  # cpud.engine.multiproc.RankEngineConfig as JSON


def plan_socket(runtime_dir: str, rank: int) -> str:
    return f"ipc://{runtime_dir}/rank{rank}.plans"


def results_socket(runtime_dir: str) -> str:
    return f"ipc://{runtime_dir}/results"


def make_group(spec: RankSpec):
    if spec.world_size == 1:
        from cpud.ranks.parallel import SingleRank

        return SingleRank()
    if spec.collective == "gloo":
        from cpud.ranks.gloo_group import GlooGroup

        return GlooGroup(spec.rank, spec.world_size, f"{spec.runtime_dir}/gloo.init")
    from cpud.native.shm_allreduce import ShmGroup

    return ShmGroup.attach(f"{spec.runtime_dir}/allreduce.shm", spec.rank, spec.world_size)


def run(spec: RankSpec) -> int:
    die_with_parent()
    started = time.perf_counter()
    warnings: list[str] = []
    if spec.cpus is not None:
        set_affinity(spec.cpus)
    if spec.numa_node is not None:
        warning = bind_memory(spec.numa_node)
        if warning:
            warnings.append(warning)

    import zmq

    from cpud.protocol.control import (
        MAX_MESSAGE_BYTES,
        RankFailed,
        Ready,
        Shutdown,
        encoder,
        to_rank_decoder,
    )

    ctx = zmq.Context()
    results = ctx.socket(zmq.PUSH)
    results.setsockopt(zmq.LINGER, 2000)
    results.connect(results_socket(spec.runtime_dir))
    try:
        cpus = spec.cpus if spec.cpus is not None else sorted(os.sched_getaffinity(0))
        thread_cpus = pin_threads(cpus) if spec.cpus is not None else []
        if spec.cpus is not None and sorted(thread_cpus) != sorted(cpus):
            warnings.append(f"threads ran on {thread_cpus}, expected one on each of {cpus}")

        from cpud.engine.multiproc import RankEngineConfig, build_runner

        config = msgspec.json.decode(spec.engine_config_json, type=RankEngineConfig)
        from cpud.ranks.stats import RankStatsCollector, TimedGroup

        group = TimedGroup(make_group(spec))
        runner = build_runner(config, group)
        bound = sum(1 for got, want in zip(thread_cpus, cpus) if got == want)
        stats = RankStatsCollector(spec.rank, spec.numa_node, cpus, bound)
        plans = ctx.socket(zmq.PULL)
        plans.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        plans.bind(plan_socket(spec.runtime_dir, spec.rank))
        results.send(
            encoder.encode(
                Ready(
                    rank=spec.rank,
                    pid=os.getpid(),
                    numa_node=spec.numa_node,
                    cpus=cpus,
                    thread_cpus=thread_cpus,
                    load_seconds=time.perf_counter() - started,
                    kernels=runner.ops.name,
                    warnings=warnings,
                )
            )
        )
        # Ranks load at different speeds; the per-collective timeout starts after this.
        group.barrier(timeout=LOAD_BARRIER_TIMEOUT_S)
        while True:
            message = to_rank_decoder.decode(plans.recv())
            if isinstance(message, Shutdown):
                return 0
            step_started = time.perf_counter()
            result = runner.execute(message)
            stats.observe_step(time.perf_counter() - step_started)
            if result is not None:
                results.send(encoder.encode(result))
            if stats.due():
                results.send(encoder.encode(stats.snapshot(group, runner.kv_cache_bytes)))
    except BaseException as exc:
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        log.error("rank %d failed: %s\n%s", spec.rank, detail, traceback.format_exc())
        results.send(encoder.encode(RankFailed(spec.rank, detail)))
        return 1
    finally:
        results.close()
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s rank %(process)d %(levelname)s %(message)s"
    )
    spec = msgspec.json.decode(Path(args[0]).read_bytes(), type=RankSpec)
    return run(spec)


if __name__ == "__main__":
    sys.exit(main())
