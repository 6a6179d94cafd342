"""Whether the engine is computing while a step runs long: the CPU time of the engine thread
(which runs the model itself in-process) and of the rank processes (the daemon's), read from
the kernel's clocks. A step that is slow because it is large keeps them busy; a hung one (a
stopped rank, a deadlock) leaves them idle."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

BUSY_SHARE = 0.05  # CPU seconds per wall second that count as computing
WINDOW = 0.2  # seconds: the shortest span judged (process CPU time comes in 10 ms ticks)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _process_cpu(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as file:
            fields = file.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


class ComputeActivity:
    """`busy()` answers whether the engine used the CPU since it was last asked."""

    def __init__(self, thread_id: int, pids: Sequence[int] = ()):
        try:
            self._clock: int | None = time.pthread_getcpuclockid(thread_id)
        except (OSError, AttributeError):
            self._clock = None
        self._wall = time.monotonic()
        self._thread_cpu = self._engine_thread_cpu()
        self._pids = tuple(pids)
        self._pids_cpu = self._processes_cpu()
        self._busy = False

    def _engine_thread_cpu(self) -> float:
        if self._clock is None:
            return 0.0
        try:
            return time.clock_gettime(self._clock)
        except OSError:
            return 0.0

    def _processes_cpu(self) -> dict[int, float]:
        readings = {pid: _process_cpu(pid) for pid in self._pids}
        return {pid: cpu for pid, cpu in readings.items() if cpu is not None}

    def busy(self) -> bool:
        """The engine thread, or every rank process, used at least BUSY_SHARE of the wall
        time since the previous judgement (asked again within WINDOW: the same answer)."""
        now = time.monotonic()
        elapsed = now - self._wall
        if elapsed < WINDOW:
            return self._busy
        floor = BUSY_SHARE * elapsed
        thread_cpu = self._engine_thread_cpu()
        busy = thread_cpu - self._thread_cpu >= floor
        ranks = self._processes_cpu()
        if not busy and ranks:
            busy = all(cpu - self._pids_cpu.get(pid, cpu) >= floor for pid, cpu in ranks.items())
        self._wall, self._thread_cpu, self._pids_cpu = now, thread_cpu, ranks
        self._busy = busy
        return busy
