"""The rank processes of one engine: spawned, watched and stopped by one owner.

The owner (the supervisor of the daemon, or the offline `LLM` in its own process) creates the
group in a private runtime directory. Ranks report READY or FAILED and a heartbeat every second
on the supervisor socket; `poll` turns every way a rank can be lost into RankDiedError naming
the rank: a FAILED report, an exit, silence for longer than the rank timeout (a stopped or
wedged process, which is then killed), or one step running past the step timeout. A rank that
is lost is aborted in the shared-memory all-reduce so its peers stop waiting for it at once.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

from cpud.process.child_process import module_command
from cpud.protocol.control import Shutdown, encoder
from cpud.protocol.launch import (
    WHEN_TOLD,
    EngineSpec,
    RankSlot,
    RankSpec,
    plan_socket,
    rank_spec_file,
)
from cpud.protocol.supervision import (
    MAX_MESSAGE_BYTES,
    Heartbeat,
    RankFailed,
    Ready,
    supervisor_socket,
    to_supervisor_decoder,
)
from cpud.settings import envs
from cpud.settings.errors import ConfigError, CpudError

log = logging.getLogger("cpud.ranks")


class RankDiedError(CpudError):
    """A rank process exited, failed or hung; the engine cannot continue."""


@dataclass(frozen=True)
class RankTimeouts:
    ready: float = 600.0  # spawn to READY (loading weights)
    silent: float = 30.0  # no heartbeat for this long: the rank is stopped or wedged
    step: float = 300.0  # one step running longer than this: the rank is hung
    fresh: float = 5.0  # heartbeats younger than this count as fresh (systemd watchdog)


def start_ranks(runtime_dir: str, count: int) -> list[subprocess.Popen]:
    """Rank processes started ahead of their specs: each imports torch and its modules while
    the owner still plans, then waits to be told on stdin that its spec file is written
    (RankGroup(started=...) does; kill_started stops them when the start is refused)."""
    env = envs.without_secrets(os.environ)
    procs = []
    for rank in range(count):
        path = rank_spec_file(runtime_dir, rank)
        command = module_command("cpud.ranks.worker", path, str(os.getpid()), WHEN_TOLD)
        procs.append(subprocess.Popen(command, stdin=subprocess.PIPE, env=env))
    return procs


def kill_started(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()


class RankGroup:
    def __init__(
        self,
        ctx: zmq.Context,
        runtime_dir: str,
        engine: EngineSpec,
        slots: list[RankSlot],
        collective: str = "shm",
        timeouts: RankTimeouts = RankTimeouts(),
        on_message: Callable[[object], None] | None = None,
        started: list[subprocess.Popen] | None = None,
    ):
        """started: processes from start_ranks in this runtime_dir, one per slot, told on stdin
        when their spec files are written (None: the ranks are spawned here)."""
        self.runtime_dir = runtime_dir
        self.world_size = len(slots)
        self.timeouts = timeouts
        self.on_message = on_message
        self.procs: list[subprocess.Popen] = []
        self.ready: dict[int, Ready] = {}
        self.last_beat: dict[int, float] = {}
        self.busy: dict[int, float] = {}
        self.failure: str | None = None
        self.failed_rank: int | None = None
        self._failure_reported = False  # the failure came from a FAILED report, not an exit
        self.reported: set[int] = set()  # ranks that sent FAILED
        self.config_failure: str | None = None  # a rank found the model unusable while loading
        self.stopping = False  # set once ranks are expected to exit
        self.ctx = ctx
        self.control = ctx.socket(zmq.PULL)
        self.control.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.bind(supervisor_socket(runtime_dir))
        self._shm = None
        if collective == "shm" and self.world_size > 1:
            from cpud.native.shm_allreduce import ShmGroup

            self._shm = ShmGroup.create(f"{runtime_dir}/allreduce.shm", self.world_size, 8 << 20)
        self._spawn(engine, slots, collective, started)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _spawn(
        self,
        engine: EngineSpec,
        slots: list[RankSlot],
        collective: str,
        started: list[subprocess.Popen] | None = None,
    ) -> None:
        now = self.spawned_at = time.monotonic()
        for rank, slot in enumerate(slots):
            spec = RankSpec(
                rank=rank,
                world_size=self.world_size,
                runtime_dir=self.runtime_dir,
                cpus=slot.cpus,
                numa_node=slot.numa_node,
                collective=collective,
                engine=engine,
            )
            self.last_beat[rank] = now
            path = Path(rank_spec_file(self.runtime_dir, rank))
            path.write_bytes(msgspec.json.encode(spec))
            if started is not None:
                self.procs.append(started[rank])
                try:
                    started[rank].stdin.write(b"written\n")
                    started[rank].stdin.close()
                except BrokenPipeError:
                    pass  # it exited already: _check_processes names it
                continue
            command = module_command("cpud.ranks.worker", str(path), str(os.getpid()))
            self.procs.append(subprocess.Popen(command, env=envs.without_secrets(os.environ)))

    def pump(self, timeout_s: float = 0.0) -> None:
        """File every waiting control message; wait up to timeout_s for the first one."""
        wait_ms = int(timeout_s * 1000)
        while self.control.poll(wait_ms):
            wait_ms = 0
            message = to_supervisor_decoder.decode(self.control.recv())
            if isinstance(message, Heartbeat) and message.role == "rank":
                self.last_beat[message.index] = time.monotonic()
                self.busy[message.index] = message.busy_seconds
            elif isinstance(message, Ready):
                self.ready[message.rank] = message
                self.last_beat[message.rank] = time.monotonic()
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
                self.reported.add(message.rank)
                if message.config_error and message.rank not in self.ready:
                    self.config_failure = self.config_failure or message.message
                self._lose(message.rank, f"rank {message.rank} failed: {message.message}")
            elif self.on_message is not None:
                self.on_message(message)

    def poll(self, timeout_s: float = 0.0) -> None:
        """File control messages, then raise RankDiedError if any rank is lost."""
        self.pump(timeout_s)
        if self.failure is None:
            self._check_processes()
        if self.failure is not None:
            self.settle()
            raise RankDiedError(self.failure)

    def _check_processes(self) -> None:
        now = time.monotonic()
        missing = sorted(set(range(self.world_size)) - set(self.ready))
        if missing and now - self.spawned_at > self.timeouts.ready:
            for rank in missing:
                self.procs[rank].kill()
            self._lose(
                missing[0],
                f"rank(s) {missing} did not report ready within {self.timeouts.ready:g} s",
                True,
            )
        for rank, proc in enumerate(self.procs):
            code = proc.poll()
            if code == 0 and self.stopping:
                continue  # told to stop: the frontend ended the ranks after a drain
            if code is not None:
                self._lose(rank, f"rank {rank} (pid {proc.pid}) exited with code {code}", True)
                continue
            silent = now - self.last_beat[rank]
            busy = self.busy.get(rank, 0.0)
            # Loading may hold the GIL for long stretches on a busy machine: until READY only
            # the ready timeout applies.
            if rank in self.ready and silent > self.timeouts.silent:
                proc.kill()
                reason = f"sent no heartbeat for {silent:.0f} s: stopped or wedged; killed"
            elif busy > self.timeouts.step:
                proc.kill()
                reason = (
                    f"ran one step for {busy:.0f} s (step timeout {self.timeouts.step:g} s): "
                    "hung; killed"
                )
            else:
                continue
            self._lose(rank, f"rank {rank} (pid {proc.pid}) {reason}", True)

    def _lose(self, rank: int, reason: str, exited: bool = False) -> None:
        if self.failure is not None:
            # A rank whose collective broke often reports first; a peer that died is the news.
            if not (exited and self._failure_reported and rank not in self.reported):
                return
        self.failure, self.failed_rank, self._failure_reported = reason, rank, not exited
        if self._shm is not None:
            self._shm.abort(rank)  # peers blocked in a collective stop waiting now
        log.error("%s", reason)

    def settle(self, grace_s: float = 1.0) -> None:
        """After a FAILED report, give a peer that died a moment to be named instead."""
        deadline = time.monotonic() + grace_s
        while self._failure_reported and time.monotonic() < deadline:
            self.pump(0)
            self._check_processes()
            time.sleep(0.05)

    def ready_in_rank_order(self) -> list[Ready]:
        return [self.ready[r] for r in range(self.world_size)]

    def wait_ready(self) -> list[Ready]:
        while len(self.ready) < self.world_size:
            try:
                self.poll(0.1)
            except RankDiedError as exc:
                if self.config_failure is not None:
                    raise ConfigError(self.config_failure) from None
                raise RankDiedError(str(exc).replace("failed:", "failed to start:", 1)) from None
        return self.ready_in_rank_order()

    def heartbeats_fresh(self) -> bool:
        now = time.monotonic()
        return self.failure is None and all(
            now - beat <= self.timeouts.fresh for beat in self.last_beat.values()
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        """Tell the ranks to exit after the step they are in, wait, then kill stragglers
        (ranks ignore SIGTERM: their owner alone decides when they stop)."""
        self.stopping = True
        for rank in range(self.world_size):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDTIMEO, 100)
            try:
                sock.connect(plan_socket(self.runtime_dir, rank))
                sock.send(encoder.encode(Shutdown()))
            except zmq.ZMQError:
                pass  # gone already
            finally:
                sock.close(linger=500)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.control.close(0)
        if self._shm is not None:
            self._shm.close()
            self._shm = None

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        self.stop(0)
