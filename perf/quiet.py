"""Waits for the machine's CPUs to go quiet before a timed run.

Interleaved engines share 2 cores, and an engine keeps working for a while after it answers:
vLLM's engine and worker processes burn about half a core for ~2 s after a request (measured:
0.50 cores in the first 2 s, 0.02 afterwards). Whatever runs next would be measured on the
remaining 1.5 cores. Each timed run therefore starts once the guest's busy time (user, nice,
system, irq, softirq; not steal, which is the host's) falls below a threshold over a window.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

BUSY_FIELDS = (0, 1, 2, 5, 6)  # user nice system irq softirq in /proc/stat's "cpu" line


def busy_ticks(stat: Path = Path("/proc/stat")) -> int:
    """Busy clock ticks of all CPUs together since boot."""
    with stat.open() as f:
        fields = f.readline().split()[1:]
    return sum(int(fields[i]) for i in BUSY_FIELDS)


def wait_until_quiet(
    max_busy_cores: float = 0.15,
    window_s: float = 0.5,
    timeout_s: float = 20.0,
    stat: Path = Path("/proc/stat"),
) -> float:
    """Blocks until one `window_s` window has used under `max_busy_cores` cores of busy time, or
    `timeout_s` passed; returns seconds waited (timeout_s or more when it never went quiet)."""
    hz = os.sysconf("SC_CLK_TCK")
    started = time.perf_counter()
    while True:
        before = busy_ticks(stat)
        time.sleep(window_s)
        cores = (busy_ticks(stat) - before) / hz / window_s
        waited = time.perf_counter() - started
        if cores < max_busy_cores or waited >= timeout_s:
            return waited
