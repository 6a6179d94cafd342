"""Decode figures paired by the host's memory-read period.

Some hosts switch by themselves between read rates (a 2-thread read probe at ~34 and at ~61 GB/s
on the same idle machine, for minutes at a time), so a decode-1 ratio of two engines measured a
minute apart may compare two memory speeds. Each engine's decode 1 is bracketed by the read
probe; a round whose readings spread past MIXED_SPREAD is "mixed", and `paired_by_period` puts
every engine's samples into the period of its own probe readings and compares the engines only
within a period.

    probe = ProbeProcess()                # or bench_moe.ReadProbe(1024) where no engine runs
    tok_s, readings = bracketed(probe, lambda: run_decode())
    summary = paired_by_period({"cpud": [(tok_s, readings), ...], "llama.cpp": [...]})
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

MIXED_SPREAD = 1.25  # probe readings further apart than this are two periods


class ProbeProcess:
    """bench_moe.ReadProbe in a process of its own, read on demand: the probe's OpenMP team
    then never shares the process of an engine whose own threads it would slow down."""

    def __init__(self, mib: int = 1024) -> None:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--serve", str(mib)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def gbs(self) -> float:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the read probe process ended (exit {self.proc.wait()})")
        return float(line)

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait()


def bracketed(probe: Any, run: Callable[[], float]) -> tuple[float, list[float]]:
    """(run()'s figure, [probe GB/s before, after])."""
    before = probe.gbs()
    value = run()
    return value, [before, probe.gbs()]


def mixed(readings: Sequence[float]) -> bool:
    """Whether these probe readings spread past MIXED_SPREAD."""
    return max(readings) > MIXED_SPREAD * min(readings)


def period_names(probes: Sequence[float]) -> list[str]:
    """Each probe reading's period: "slow" or "fast" of the middle of their range where it
    spreads past MIXED_SPREAD, else "one"."""
    if not mixed(probes):
        return ["one"] * len(probes)
    split = (min(probes) + max(probes)) / 2
    return ["fast" if p >= split else "slow" for p in probes]


def paired_by_period(samples: dict[str, list[tuple[float, list[float]]]]) -> dict[str, Any]:
    """samples: engine -> [(tok/s, its probe readings), ...]. A sample whose own readings are
    mixed is left out; the rest split at the middle of the probe's range into "slow" and "fast"
    when that range spreads past MIXED_SPREAD (else one period, "one"). Per period: each engine's
    median tok/s and probe, and the first engine's ratio to each other where both have samples."""
    clean = {
        engine: [(v, statistics.mean(r)) for v, r in rows if not mixed(r)]
        for engine, rows in samples.items()
    }
    flat = [(engine, value, p) for engine, rows in clean.items() for value, p in rows]
    if not flat:
        return {"periods": {}, "left_out_mixed": sum(len(r) for r in samples.values())}
    periods: dict[str, dict[str, Any]] = {}
    for (engine, value, probe), name in zip(flat, period_names([p for *_, p in flat]), strict=True):
        periods.setdefault(name, {}).setdefault(engine, []).append((value, probe))
    first = next(iter(samples))
    out: dict[str, Any] = {}
    for name, engines in periods.items():
        entry: dict[str, Any] = {
            engine: {
                "tok_s": statistics.median(v for v, _ in rows),
                "probe_gbs": statistics.median(p for _, p in rows),
                "samples": len(rows),
            }
            for engine, rows in engines.items()
        }
        if first in engines:
            for other in engines:
                if other != first:
                    entry[f"ratio_{first}_to_{other}"] = (
                        entry[first]["tok_s"] / entry[other]["tok_s"]
                    )
        out[name] = entry
    left_out = sum(len(rows) for rows in samples.values()) - sum(len(r) for r in clean.values())
    return {"periods": out, "left_out_mixed": left_out}


def serve(mib: int) -> None:
    """One probe reading on stdout per line on stdin."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_moe import ReadProbe

    probe = ReadProbe(mib)
    for _ in sys.stdin:
        print(probe.gbs(), flush=True)


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
    serve(int(sys.argv[2]))
