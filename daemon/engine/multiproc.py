"""Runs step plans on one rank process per tensor-parallel shard.

The executor creates a private 0700 runtime directory for the IPC sockets (and the shared
memory segment), spawns the ranks, waits for every READY (naming any rank that fails or never
answers), then sends each plan to all ranks in lockstep and returns rank 0's result. A rank
that dies or fails makes `execute` raise RankDiedError within a second; ranks die with their
parent (PR_SET_PDEATHSIG), so no orphan survives any exit path.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch
import zmq

from cpud.config import EngineConfig
from cpud.errors import ConfigError, CpudError
from cpud.protocol.control import (
    MAX_MESSAGE_BYTES,
    RankFailed,
    RankStats,
    Ready,
    Shutdown,
    encoder,
    from_rank_decoder,
)
from cpud.protocol.step import StepPlan, StepResult
from cpud.ranks.model_config import load_model_config
from cpud.ranks.model_runner import ModelRunner, RunnerConfig
from cpud.ranks.worker import RankSpec, plan_socket, results_socket

log = logging.getLogger("cpud.executor")
POLL_MS = 100


class RankDiedError(CpudError):
    """A rank process exited or failed; the engine cannot continue."""


class RankEngineConfig(msgspec.Struct, frozen=True):
    """What a rank needs to build its runner (sent as JSON in its spec)."""

    model_dir: str
    dtype: str
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    seed: int
    kernels: str


def build_runner(config: RankEngineConfig, group: object) -> ModelRunner:
    runner_config = RunnerConfig(
        model_dir=Path(config.model_dir),
        dtype=getattr(torch, config.dtype),
        max_model_len=config.max_model_len,
        block_size=config.block_size,
        num_kv_blocks=config.num_kv_blocks,
        seed=config.seed,
        kernels=config.kernels,
    )
    return ModelRunner(runner_config, load_model_config(config.model_dir), group)


@dataclass(frozen=True)
class RankSlot:
    cpus: list[int] | None
    numa_node: int | None


def runtime_parent() -> str:
    return os.environ.get("RUNTIME_DIRECTORY") or os.environ.get("XDG_RUNTIME_DIR") or "/tmp"


class MultiprocExecutor:
    def __init__(
        self,
        config: EngineConfig,
        slots: list[RankSlot],
        collective: str = "shm",
        ready_timeout: float = 300.0,
        step_timeout: float = 300.0,
    ):
        if len(slots) != config.tp:
            raise ConfigError(f"{len(slots)} rank placements for tp={config.tp}")
        self.config = config
        self.step_timeout = step_timeout
        self.runtime_dir = tempfile.mkdtemp(prefix="cpud-", dir=runtime_parent())
        os.chmod(self.runtime_dir, 0o700)
        self.ctx = zmq.Context()
        self.results = self.ctx.socket(zmq.PULL)
        self.results.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.results.bind(results_socket(self.runtime_dir))
        self.plans: list[zmq.Socket] = []
        self.procs: list[subprocess.Popen] = []
        self.ready: list[Ready] = []
        self.stats: dict[int, RankStats] = {}
        self._shm = None
        try:
            if collective == "shm" and config.tp > 1:
                from cpud.native.shm_allreduce import ShmGroup

                self._shm = ShmGroup.create(f"{self.runtime_dir}/allreduce.shm", config.tp, 8 << 20)
            self._spawn(slots, collective)
            self._await_ready(ready_timeout)
            for rank in range(config.tp):
                sock = self.ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(plan_socket(self.runtime_dir, rank))
                self.plans.append(sock)
        except BaseException:
            self.shutdown()
            raise

    def _spawn(self, slots: list[RankSlot], collective: str) -> None:
        engine = RankEngineConfig(
            model_dir=str(self.config.model_dir),
            dtype=str(self.config.dtype).removeprefix("torch."),
            max_model_len=self.config.max_model_len,
            block_size=self.config.block_size,
            num_kv_blocks=self.config.num_kv_blocks,
            seed=self.config.seed,
            kernels=self.config.kernels,
        )
        for rank, slot in enumerate(slots):
            spec = RankSpec(
                rank=rank,
                world_size=self.config.tp,
                runtime_dir=self.runtime_dir,
                cpus=slot.cpus,
                numa_node=slot.numa_node,
                collective=collective,
                engine_config_json=msgspec.json.encode(engine).decode(),
            )
            path = Path(self.runtime_dir) / f"rank{rank}.json"
            path.write_bytes(msgspec.json.encode(spec))
            self.procs.append(
                subprocess.Popen([sys.executable, "-m", "cpud.ranks.worker", str(path)])
            )

    def check_health(self) -> None:
        message = self._receive(0)
        if isinstance(message, RankFailed):
            raise RankDiedError(f"rank {message.rank} failed: {message.message}")
        self._check_alive()

    def _check_alive(self) -> None:
        for rank, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None:
                if self._shm is not None:
                    self._shm.abort(rank)  # peers blocked in a collective stop waiting now
                raise RankDiedError(f"rank {rank} (pid {proc.pid}) exited with code {code}")

    def _receive(self, timeout_s: float) -> object | None:
        """The next message that needs an answer; statistics are filed on the way."""
        while self.results.poll(int(timeout_s * 1000)):
            message = from_rank_decoder.decode(self.results.recv())
            if not isinstance(message, RankStats):
                return message
            self.stats[message.rank] = message
        return None

    def rank_stats(self) -> list[RankStats]:
        return [self.stats[r] for r in sorted(self.stats)]

    def _await_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        ready: dict[int, Ready] = {}
        while len(ready) < self.config.tp:
            message = self._receive(POLL_MS / 1000)
            if isinstance(message, Ready):
                ready[message.rank] = message
                for warning in message.warnings:
                    log.warning("rank %d: %s", message.rank, warning)
                log.info(
                    "rank %d ready in %.1f s: pid %d, node %s, threads on cpus %s, kernels %s",
                    message.rank,
                    message.load_seconds,
                    message.pid,
                    message.numa_node,
                    message.thread_cpus,
                    message.kernels,
                )
            elif isinstance(message, RankFailed):
                raise RankDiedError(f"rank {message.rank} failed to start: {message.message}")
            self._check_alive()
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.config.tp)) - set(ready))
                raise RankDiedError(f"rank(s) {missing} did not report ready within {timeout:g} s")
        self.ready = [ready[r] for r in range(self.config.tp)]

    def execute(self, plan: StepPlan) -> StepResult:
        payload = encoder.encode(plan)
        for sock in self.plans:
            sock.send(payload, copy=False)
        deadline = time.monotonic() + self.step_timeout
        while True:
            if time.monotonic() > deadline:
                raise RankDiedError(
                    f"no result for step {plan.step_id} within {self.step_timeout:g} s: "
                    f"a rank is hung (pids {[p.pid for p in self.procs]})"
                )
            message = self._receive(POLL_MS / 1000)
            if isinstance(message, StepResult) and message.step_id == plan.step_id:
                return message
            if isinstance(message, RankFailed):
                self._blame_dead_peer()
                raise RankDiedError(f"rank {message.rank} failed: {message.message}")
            self._check_alive()

    def _blame_dead_peer(self, grace_s: float = 1.0) -> None:
        """A rank whose collective broke usually reports first; name the one that died."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            self._check_alive()
            time.sleep(0.05)

    def shutdown(self) -> None:
        if self.ctx.closed:
            return
        for sock in self.plans:
            try:
                sock.send(encoder.encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for sock in self.plans:
            sock.close(0)
        self.plans = []
        self.results.close(0)
        self.ctx.term()
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
