"""Host memory bandwidth over time: the native read probe, sampled every --interval s.

    python3 perf/bench_host.py --seconds 30
    python3 perf/bench_host.py --seconds 20 --json perf/results/host.json

On a shared host (this machine is a VM) other tenants take memory bandwidth. A plain read of
a 256 MiB buffer by both cores swung between ~10 and ~52 GB/s within seconds here, every
buffer at once (2026-11-22), so the swings are the host's, not page placement. Decode at one
stream reads every weight once per token and follows these swings; two engines measured a
few seconds apart can see bandwidths 2x apart. This prints the spread (min, p10, median, p90,
max GB/s) and the CPU time the host stole over the window (/proc/stat "steal"), so a ratio
from the same hour can be judged against it. The suite runs it before and after its modules.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from cpud import native
from cpud.native.hugepages import huge_empty

STEAL_FIELD = 7  # in /proc/stat's "cpu" line, after the label


def steal_ticks(stat: Path = Path("/proc/stat")) -> int:
    """Clock ticks the host has taken from this guest's CPUs since boot."""
    with stat.open() as f:
        fields = f.readline().split()[1:]
    return int(fields[STEAL_FIELD]) if len(fields) > STEAL_FIELD else 0


def spread(samples: list[float]) -> dict[str, float]:
    """min, p10, median, p90, max of samples (GB/s) and the share below half the max."""
    if not samples:
        raise ValueError("no samples")
    ordered = sorted(samples)
    deciles = statistics.quantiles(ordered, n=10) if len(ordered) > 1 else [ordered[0]] * 9
    top = ordered[-1]
    return {
        "min": ordered[0],
        "p10": deciles[0],
        "median": statistics.median(ordered),
        "p90": deciles[-1],
        "max": top,
        "below_half_max": sum(s < top / 2 for s in ordered) / len(ordered),
    }


def trace(seconds: float, interval: float, mib: int) -> dict[str, Any]:
    """Samples the read probe over a fresh huge-page buffer of `mib` MiB every `interval` s for
    `seconds` s; returns the samples (GB/s, at seconds since start), their spread and the
    host's steal time over the window in cores."""
    if seconds <= 0 or interval <= 0 or mib < 16:
        raise ValueError("need seconds > 0, interval > 0 and a buffer of at least 16 MiB")
    kern = native.kernels()
    buf = huge_empty((mib << 20,), torch.uint8)
    buf.random_(0, 256)  # populated, and random: constant pages can read slower (read_probe)
    kern.read_probe(buf)
    hz = os.sysconf("SC_CLK_TCK")
    steal_before, started = steal_ticks(), time.perf_counter()
    at, gbs = [], []
    while (now := time.perf_counter() - started) < seconds:
        t0 = time.perf_counter()
        kern.read_probe(buf)
        gbs.append(buf.numel() / (time.perf_counter() - t0) / 1e9)
        at.append(round(now, 3))
        time.sleep(max(0.0, interval - (time.perf_counter() - t0)))
    elapsed = time.perf_counter() - started
    return {
        "seconds": elapsed,
        "interval_s": interval,
        "buffer_mib": mib,
        "threads": torch.get_num_threads(),
        "isa": native.isa(),
        "read_gbs": spread(gbs),
        "steal_cores": (steal_ticks() - steal_before) / hz / elapsed,
        "samples": {"at_s": at, "gbs": gbs},
    }


def describe(result: dict[str, Any]) -> str:
    """One line: the spread of read bandwidth and the steal over the window."""
    s = result["read_gbs"]
    return (
        f"read probe ({result['buffer_mib']} MiB, {result['threads']} threads, every "
        f"{result['interval_s']:g} s for {result['seconds']:.0f} s): min {s['min']:.1f}, p10 "
        f"{s['p10']:.1f}, median {s['median']:.1f}, p90 {s['p90']:.1f}, max {s['max']:.1f} GB/s; "
        f"{100 * s['below_half_max']:.0f} % of samples under half the max; host steal "
        f"{result['steal_cores']:.2f} cores"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--interval", type=float, default=0.2, help="seconds between samples")
    ap.add_argument("--mib", type=int, default=256, help="buffer size (>> L3)")
    ap.add_argument("--json", type=Path, help="write the samples and spread here")
    args = ap.parse_args()
    try:
        result = trace(args.seconds, args.interval, args.mib)
    except ValueError as e:
        ap.error(str(e))
    print(describe(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
