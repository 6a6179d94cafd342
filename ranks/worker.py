"""One rank process: bind, pin, load its weight shard, then execute step plans in lockstep.

    python -m cpud.ranks.worker SPEC_JSON PARENT_PID [--when-told]

The rank dies with PARENT_PID, its owner (armed before anything else). The spec (a
cpud.protocol.launch.RankSpec, msgspec JSON) says where to run, where the sockets are and the
resolved engine config. With --when-told the rank imports torch and its modules, then waits
for its owner to write the spec and say so on its stdin (stdin closed unwritten: the start was
refused, exit 0): the supervisor starts its ranks so while it still checks the model and plans.
Importing allocates nothing of the rank's: the affinity and memory policy are still set before
the weights, the KV cache and the OpenMP threads (started in pin_threads) exist. Every rank
reports READY (or FAILED) and a heartbeat every second to the supervisor; step plans come from
the frontend, and rank 0 returns each step's sampled tokens to it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from cpud.process.log_setup import replica_tag
from cpud.protocol.launch import WHEN_TOLD, EngineSpec, RankSpec, plan_socket, results_socket
from cpud.ranks.binding import bind_memory, die_with_parent, pin_threads, set_affinity

if TYPE_CHECKING:
    from cpud.model.model_config import ModelConfig
    from cpud.ranks.model_runner import ModelRunner, RunnerConfig

log = logging.getLogger("cpud.rank")
LOAD_BARRIER_TIMEOUT_S = 1800.0
STATS_INTERVAL_MS = 1000


def runner_config(engine: EngineSpec) -> RunnerConfig:
    """The runner's own config (torch dtypes, paths): built where the model runs."""
    import torch

    from cpud.ranks.model_runner import RunnerConfig

    return RunnerConfig(
        model_dir=Path(engine.model_dir),
        dtype=getattr(torch, engine.dtype),
        max_model_len=engine.max_model_len,
        block_size=engine.block_size,
        num_kv_blocks=engine.num_kv_blocks,
        seed=engine.seed,
        kernels=engine.kernels,
        weight_cache=Path(engine.weight_cache) if engine.weight_cache else None,
        kv_pretouch=engine.kv_pretouch,
        quantization=engine.quantization,
        kv_cache_dtype=engine.kv_cache_dtype,
        speculative_config=engine.speculative_config,
    )


def model_config(engine: EngineSpec) -> ModelConfig:
    """The model's config from the facts the spec carries (a GGUF file's tensors are then mapped
    from its tensor table, no metadata parsed), else read from the model's files."""
    from cpud.model.load import config_from_facts, load_model_config

    if engine.model is None:
        return load_model_config(engine.model_dir)
    config = config_from_facts(engine.model)
    path = Path(engine.model_dir)
    if engine.model.tensors is not None:
        from cpud.model.gguf_facts import adopt_gguf_facts

        if not adopt_gguf_facts(path, engine.model, config):
            log.info("%s changed since the supervisor read it: reading it again", path)
            return load_model_config(path)
    return config


def build_runner(
    engine: EngineSpec, group: object, progress: Callable[[int, int], None] | None = None
) -> ModelRunner:
    from cpud.ranks.model_runner import ModelRunner

    return ModelRunner(runner_config(engine), model_config(engine), group, progress)


def make_group(spec: RankSpec):
    if spec.world_size == 1:
        from cpud.ranks.parallel import SingleRank

        return SingleRank()
    if spec.collective == "gloo":
        from cpud.ranks.gloo_group import GlooGroup

        return GlooGroup(spec.rank, spec.world_size, f"{spec.runtime_dir}/gloo.init")
    from cpud.native.shm_allreduce import ShmGroup

    return ShmGroup.attach(f"{spec.runtime_dir}/allreduce.shm", spec.rank, spec.world_size)


class StepClock:
    """When the current step started (None while idle), read by the heartbeat thread."""

    def __init__(self) -> None:
        self.started: float | None = None

    def busy_seconds(self) -> float:
        started = self.started
        return 0.0 if started is None else time.monotonic() - started


def start_heartbeat(
    ctx, spec: RankSpec, clock: StepClock, stop: threading.Event
) -> threading.Thread:
    """A thread that keeps telling the supervisor this process is alive (and how long its
    current step has run), while loading and while serving."""
    import zmq

    from cpud.protocol.supervision import (
        HEARTBEAT_INTERVAL_S,
        Heartbeat,
        encoder,
        supervisor_socket,
    )

    def beat() -> None:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)
        sock.connect(supervisor_socket(spec.runtime_dir))
        try:
            while not stop.is_set():
                beat = Heartbeat("rank", spec.rank, os.getpid(), clock.busy_seconds())
                try:
                    sock.send(encoder.encode(beat), zmq.NOBLOCK)
                except zmq.Again:
                    pass
                except zmq.ZMQError:
                    return  # the context is closing
                stop.wait(HEARTBEAT_INTERVAL_S)
        finally:
            sock.close()

    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    return thread


def run(spec: RankSpec) -> int:
    started = time.perf_counter()
    warnings: list[str] = []
    if spec.cpus is not None and (warning := set_affinity(spec.cpus)):
        warnings.append(warning)
    if spec.numa_node is not None:
        warning = bind_memory(spec.numa_node)
        if warning:
            warnings.append(warning)

    import zmq

    from cpud.protocol.control import MAX_MESSAGE_BYTES, Shutdown, encoder, to_rank_decoder
    from cpud.protocol.supervision import RankFailed, Ready, supervisor_socket

    ctx = zmq.Context()
    clock = StepClock()
    stop_heartbeat = threading.Event()
    heartbeat = start_heartbeat(ctx, spec, clock, stop_heartbeat)
    control = ctx.socket(zmq.PUSH)
    control.setsockopt(zmq.LINGER, 2000)
    control.connect(supervisor_socket(spec.runtime_dir))
    results = ctx.socket(zmq.PUSH)
    results.setsockopt(zmq.LINGER, 2000)
    results.connect(results_socket(spec.runtime_dir))
    try:
        cpus = spec.cpus if spec.cpus is not None else sorted(os.sched_getaffinity(0))
        thread_cpus = pin_threads(cpus) if spec.cpus is not None else []
        if spec.cpus is not None and sorted(thread_cpus) != sorted(cpus):
            warnings.append(f"threads ran on {thread_cpus}, expected one on each of {cpus}")

        from cpud.ranks.load_progress import LoadProgress
        from cpud.ranks.stats import RankStatsCollector, TimedGroup

        group = TimedGroup(make_group(spec))
        # Rank 0 shows the progress for all (ranks load their slices side by side).
        progress = LoadProgress("loading weights") if spec.rank == 0 else None
        runner = build_runner(spec.engine, group, progress)
        bound = sum(1 for got, want in zip(thread_cpus, cpus) if got == want)
        stats = RankStatsCollector(spec.rank, spec.numa_node, cpus, bound, runner.helper_threads)
        plans = ctx.socket(zmq.PULL)
        plans.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        plans.bind(plan_socket(spec.runtime_dir, spec.rank))
        control.send(
            encoder.encode(
                Ready(
                    rank=spec.rank,
                    pid=os.getpid(),
                    numa_node=spec.numa_node,
                    cpus=cpus,
                    thread_cpus=thread_cpus,
                    load_seconds=time.perf_counter() - started,
                    kernels=runner.ops.name,
                    num_kv_blocks=spec.engine.num_kv_blocks,
                    warnings=warnings,
                )
            )
        )
        # Ranks load at different speeds; the per-collective timeout starts after this.
        group.barrier(timeout=LOAD_BARRIER_TIMEOUT_S)
        results.send(encoder.encode(stats.snapshot(group, runner.kv_cache_bytes)))
        while True:
            if not plans.poll(STATS_INTERVAL_MS):  # idle: keep the metrics current
                results.send(encoder.encode(stats.snapshot(group, runner.kv_cache_bytes)))
                continue
            message = to_rank_decoder.decode(plans.recv())
            if isinstance(message, Shutdown):
                return 0
            step_started = time.perf_counter()
            clock.started = time.monotonic()
            result = runner.execute(message)
            clock.started = None
            stats.observe_step(time.perf_counter() - step_started)
            if result is not None:
                results.send(encoder.encode(result))
            if stats.due():
                results.send(encoder.encode(stats.snapshot(group, runner.kv_cache_bytes)))
    except BaseException as exc:
        from cpud.settings.errors import ConfigError

        if isinstance(exc, ConfigError):
            log.error("rank %d cannot load the model: %s", spec.rank, exc)
            control.send(encoder.encode(RankFailed(spec.rank, str(exc), config_error=True)))
            return 1
        from cpud.native import GroupAborted, PeerDied

        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        if isinstance(exc, (GroupAborted, PeerDied)):  # another rank's failure, named there
            log.error("rank %d stops: %s", spec.rank, detail)
        else:
            log.error("rank %d failed: %s\n%s", spec.rank, detail, traceback.format_exc())
        control.send(encoder.encode(RankFailed(spec.rank, detail)))
        return 1
    finally:
        stop_heartbeat.set()
        heartbeat.join(5)
        ctx.destroy(linger=2000)  # every socket, the plans one included, then the context


def read_spec(path: str, when_told: bool = False) -> RankSpec | None:
    """The spec from its file; when_told: once the rank's modules are imported and the owner
    said on stdin that the file is written (None: stdin closed unwritten, the start refused)."""
    if when_told:
        import torch  # noqa: F401  (what the wait is for)

        import cpud.ranks.model_runner  # noqa: F401

        if not sys.stdin.buffer.read():
            return None
    return msgspec.json.decode(Path(path).read_bytes(), type=RankSpec)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    die_with_parent(int(args[1]))
    # Ctrl-C, `timeout` and `kill -- -PGID` signal the whole process group; the owner decides
    # when ranks stop (a Shutdown message after the drain, or SIGKILL).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s rank %(process)d{replica_tag()} %(levelname)s %(message)s",
    )
    spec = read_spec(args[0], WHEN_TOLD in args[2:])
    return 0 if spec is None else run(spec)


if __name__ == "__main__":
    sys.exit(main())
