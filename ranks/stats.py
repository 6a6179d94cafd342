"""Per-rank counters for metrics: steps, forward and all-reduce time, threads, memory."""

from __future__ import annotations

import os
import time

import torch

from cpud.protocol.control import RankStats

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class TimedGroup:
    """Wraps a TP group and accumulates the wall time spent in all-reduce."""

    def __init__(self, group: object):
        self.group = group
        self.rank = group.rank
        self.size = group.size
        self.seconds = 0.0
        self.calls = 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        out = self.group.all_reduce(tensor)
        self.seconds += time.perf_counter() - started
        self.calls += 1
        return out

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor | None:
        return self.group.gather_last_dim(tensor)

    def barrier(self, timeout: float | None = None) -> None:
        if hasattr(self.group, "barrier"):
            self.group.barrier(timeout=timeout)


def _thread_ticks() -> dict[int, int]:
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks[int(tid)] = int(fields[11]) + int(fields[12])
    return ticks


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RankStatsCollector:
    def __init__(
        self,
        rank: int,
        numa_node: int | None,
        cpus: list[int],
        threads_bound: int,
        helper_threads: frozenset[int] = frozenset(),
    ):
        self.rank = rank
        self.numa_node = numa_node
        self.cpus = cpus
        self.threads_bound = threads_bound
        self.helper_threads = helper_threads  # e.g. the KV pre-fault: not compute threads
        self.steps = 0
        self.step_seconds = 0.0
        self._ticks = _thread_ticks()
        self._last = time.monotonic()

    def observe_step(self, seconds: float) -> None:
        self.steps += 1
        self.step_seconds += seconds

    def due(self, interval: float = 1.0) -> bool:
        return time.monotonic() - self._last >= interval

    def snapshot(self, group: TimedGroup | None, kv_bytes: int) -> RankStats:
        ticks = _thread_ticks()
        # zmq I/O and heartbeat threads count too; they rarely tick, but never report more
        # busy threads than the rank runs.
        busy = min(
            len(self.cpus),
            sum(
                1
                for t, n in ticks.items()
                if n > self._ticks.get(t, 0) and t not in self.helper_threads
            ),
        )
        self._ticks = ticks
        self._last = time.monotonic()
        return RankStats(
            rank=self.rank,
            numa_node=self.numa_node,
            steps=self.steps,
            step_seconds=self.step_seconds,
            allreduce_seconds=group.seconds if group else 0.0,
            allreduce_calls=group.calls if group else 0,
            threads=len(self.cpus),
            threads_bound=self.threads_bound,
            threads_busy=busy,
            resident_bytes=_resident_bytes(),
            kv_bytes=kv_bytes,
        )
