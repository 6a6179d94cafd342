"""Whether the engine is computing while a step runs long: the CPU time of the engine thread
(which runs the model itself at tp=1) and of this process's child processes (the rank
processes at tp > 1), read from the kernel's clocks. A step that is slow because it is large
keeps them busy; a hung one (a stopped rank, a deadlock) leaves them idle."""

from __future__ import annotations

import os
import time

BUSY_SHARE = 0.05  # CPU seconds per wall second that count as computing
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _children() -> list[int]:
    """Child processes of every thread of this process."""
    pids: list[int] = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return pids
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/children") as file:
                pids += [int(pid) for pid in file.read().split()]
        except (OSError, ValueError):
            continue
    return pids


def _process_cpu(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as file:
            fields = file.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


class ComputeActivity:
    """`busy()` answers whether the engine used the CPU since it was last asked."""

    def __init__(self, thread_id: int):
        try:
            self._clock: int | None = time.pthread_getcpuclockid(thread_id)
        except (OSError, AttributeError):
            self._clock = None
        self._wall = time.monotonic()
        self._thread_cpu = self._engine_thread_cpu()
        self._children_cpu: dict[int, float] = {}

    def _engine_thread_cpu(self) -> float:
        if self._clock is None:
            return 0.0
        try:
            return time.clock_gettime(self._clock)
        except OSError:
            return 0.0

    def busy(self) -> bool:
        """The engine thread, or every child process, used at least BUSY_SHARE of the wall
        time since the previous call."""
        now = time.monotonic()
        elapsed = max(now - self._wall, 1e-6)
        floor = BUSY_SHARE * elapsed
        thread_cpu = self._engine_thread_cpu()
        busy = thread_cpu - self._thread_cpu >= floor
        children = {}
        for pid in _children():
            cpu = _process_cpu(pid)
            if cpu is not None:
                children[pid] = cpu
        if not busy and children:
            busy = all(
                cpu - self._children_cpu.get(pid, cpu) >= floor for pid, cpu in children.items()
            )
        self._wall, self._thread_cpu, self._children_cpu = now, thread_cpu, children
        return busy
