"""Paired A/B of the quantized GEMM: a baseline build of the native library against this tree's.

Both libraries are loaded into one process (ab_gemm_split.start_ab) and called in turns on the
same packed weights, inputs and threads; every timed sweep walks copies of the weight on huge
pages totalling --pool-mib, so the weights come from memory as in decode.  Per case: median GB/s
of the GGUF bytes of each side, the paired ratio new/base with its spread, and the read probe of
the same rounds.  The two sides take turns being first in a round (A B, then B A); a --pool-mib
that fits in cache (up to IN_CACHE_POOL) times the kernels' compute instead, each timed sweep
after an untimed one.  Outputs are compared only for size: a change of summation order (as between
single- and two-stream kernels) moves the last bits.

    git worktree add /tmp/base <commit before the change>
    (cd /tmp/base && python native/build_native.py)
    python perf/ab_quant_gemm.py --base /tmp/base/native/_cpud_native.abi3.so \
        [--isas avx2 amx] [--formats Q8_0 Q4_K] [--batches 1 32] [--reps 9]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import numpy as np
import torch
from ab_gemm_split import add_ab_args, start_ab
from bench_quant_kernels import ReadProbe, huge_copy, random_rows, raw_call

from cpud import native
from cpud.native import quant

SHAPES = [("qkv", 4096, 1024), ("gate+up", 6144, 1024), ("down", 1024, 3072)]
IN_CACHE_POOL = 64 << 20  # bytes of weight copies up to which a sweep can run from cache


def sweep(lib: Any, calls: list[tuple]) -> float:
    t0 = time.perf_counter()
    for args in calls:
        lib.cpud_quant_gemm(*args)
    return time.perf_counter() - t0


def case(base: Any, isa: str, flags: int, fmt: str, n: int, k: int, m: int, args) -> dict:
    w = quant.pack_quantized(random_rows(fmt, n, k, np.random.default_rng(0)), fmt, n, k)
    copies = max(2, (args.pool_mib << 20) // w.weight_bytes)
    pool = [w] + [
        dataclasses.replace(w, qs=huge_copy(w.qs), sc=huge_copy(w.sc)) for _ in range(copies - 1)
    ]
    x, out = torch.randn(m, k), torch.empty(m, n)
    code = native.ISAS.index(isa)
    calls = [(code, flags, *raw_call(x, p, out)[2:]) for p in pool]
    libs = (base, native._loader.lib)
    for lib in libs:
        sweep(lib, calls)
    times: tuple[list[float], list[float]] = ([], [])
    probe, probe_gbs = args.probe, []
    # a pool that fits in cache is swept once untimed before each timed sweep: the probe
    # between rounds empties the caches, and the side timed right after it would read memory
    in_cache = copies * w.weight_bytes <= IN_CACHE_POOL
    for rep in range(args.reps):
        for side in (0, 1) if rep % 2 == 0 else (1, 0):  # A B, then B A
            if in_cache:
                sweep(libs[side], calls)
            times[side].append(sweep(libs[side], calls))
        t0 = time.perf_counter()
        probe()
        probe_gbs.append(probe.bytes / (time.perf_counter() - t0) / 1e9)
    ratios = sorted(b / a for a, b in zip(*times))
    gbs = [w.gguf_bytes * copies / statistics.median(t) / 1e9 for t in times]
    return {
        "isa": isa if not flags else f"{isa} (no VNNI)",
        "format": fmt,
        "n": n,
        "k": k,
        "m": m,
        "base_gbs": gbs[0],
        "new_gbs": gbs[1],
        "probe_gbs": statistics.median(probe_gbs),
        "speedup": 1 / statistics.median(ratios),
        "speedup_lo": 1 / ratios[(3 * len(ratios)) // 4],
        "speedup_hi": 1 / ratios[len(ratios) // 4],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_ab_args(ap)
    ap.add_argument("--no-vnni", action="store_true", help="also each tier's vpmaddubsw kernels")
    ap.add_argument("--formats", nargs="+", default=["Q8_0", "Q4_0", "Q4_K", "Q6_K"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--pool-mib", type=int, default=640, help="weight copies per case (>> L3)")
    args = ap.parse_args()
    isas, base = start_ab(args)
    args.probe = ReadProbe(1 << 30)
    print("| isa | format | N x K | M | base GB/s | new GB/s | probe GB/s | new/base speed (IQR) |")
    print("|---|---|---|---:|---:|---:|---:|---|")
    for isa in isas:
        for flags in (0, quant.NO_VNNI) if args.no_vnni else (0,):
            for fmt in args.formats:
                for _, n, k in SHAPES:
                    for m in args.batches:
                        r = case(base, isa, flags, fmt, n, k, m, args)
                        print(
                            f"| {r['isa']} | {fmt} | {n} x {k} | {m} | {r['base_gbs']:.1f} | "
                            f"{r['new_gbs']:.1f} | {r['probe_gbs']:.1f} | {r['speedup']:.2f}x "
                            f"({r['speedup_lo']:.2f}-{r['speedup_hi']:.2f}) |",
                            flush=True,
                        )


if __name__ == "__main__":
    main()
