"""Quantized-GEMM benchmark: cpud's int8 kernels on GGUF blocks vs the read probe, the int8
instruction peak, torch bf16 F.linear and cpud's bf16 gemm_packed, on Qwen3-0.6B shapes.

Per format and shape: GEMV (M=1) GB/s of the GGUF bytes of the weight (the file's bytes, not
the packed ones), with every timed sweep walking a pool of distinct weight copies of about
--pool-mb so weights come from DRAM; the native AVX-512 read probe over one buffer of the same
size (DRAM-sized too, not a cache-sized one) is timed in the same rounds, right before.  Copies
and probe buffer sit on transparent huge pages, as the ranks' packed weights do (the share of
their bytes the kernel backs with huge pages is printed).  quant/probe is the median over rounds
of each round's ratio: the machine's load (other processes on the same cores stall a thread of
the team, halving a sweep) moves both within a round, so the ratio of two medians taken from
different rounds jumps with it.  "best" columns: the fastest round of each, the figure of a quiet
machine.  "in cache": one copy of at most --cache-kb KiB per thread (the shape's rows, fewer where
that is more) called repeatedly, its fastest round: the kernel's compute speed at M=1; a format
whose in-cache GB/s is near the probe's DRAM GB/s cannot stream at DRAM speed.
Batches (default M=32, 64, 512): one row per kernel path
quant_gemm can take at that M (on the amx tier: AMX-BF16 tiles on dequantized groups from
bf16_tile_rows, AMX-INT8 tiles from 16 rows, AVX512-VNNI), GOP/s (2 M N K) on one
cache-resident copy, against the int8 instruction peak of the int8 paths (independent
vpdpbusd, or vpmaddubsw + vpmaddwd, in registers on every thread; independent 16 x 16 x 64
tdpbssd tiles), and the ratio to cpud's bf16 gemm_packed (AMX-BF16 tiles on the amx tier).
Rounds interleave probe, quant, torch bf16, cpud bf16 (A B A B); figures are medians over
--reps rounds.  Random weights: speed does not depend on values.

The timed quant calls go straight to the C entry point (as the fused decoder would), without
the ~2.5 us of argument checks of the Python wrapper; the bf16 calls keep their wrappers.

    python perf/bench_quant_kernels.py [--threads 2] [--reps 5] [--pool-mb 1024]
        [--cache-kb 512] [--formats Q4_K Q8_0] [--batches 32 64 512]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from cpud import native
from cpud.native import quant
from cpud.native.hugepages import huge_empty
from cpud.native.kernels import Kernels

# (layer, N, K) of Qwen3-0.6B: hidden 1024, q 2048, intermediate 3072, vocab 151936
SHAPES = [
    ("q", 2048, 1024),
    ("gate/up", 3072, 1024),
    ("gate+up", 6144, 1024),
    ("down", 1024, 3072),
    ("lm_head", 151936, 1024),
]
LM_HEAD_FORMATS = ("Q8_0", "Q6_K")


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def random_rows(name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, bytes per row] GGUF blocks with random quants and small fp16 scales."""
    _, bs, tsize, _, _ = quant.QTYPES[name]
    blk = rng.integers(0, 256, (n, k // bs, tsize), dtype=np.uint8)
    scale = np.full((n, k // bs, 2), 1e-3, np.float16).view(np.uint8)
    if name == "Q6_K":
        blk[..., 208:210] = scale[..., :2]
    else:
        blk[..., 0 : scale.shape[-1]] = scale
    return blk.reshape(n, -1)


def huge_copy(t: torch.Tensor) -> torch.Tensor:
    """t on transparent huge pages, as the ranks hold their weights (4 KiB pages read ~30 %
    slower here, and would make every figure, the probe's included, a page-walk figure)."""
    out = huge_empty(tuple(t.shape), t.dtype)
    out.copy_(t)
    return out


def copies_of(w: Any, nbytes: int, pool: int) -> list[Any]:
    count = max(1, -(-pool // nbytes))
    if isinstance(w, quant.QuantWeight):
        return [w] + [
            dataclasses.replace(w, qs=huge_copy(w.qs), sc=huge_copy(w.sc)) for _ in range(count - 1)
        ]
    if isinstance(w, native.PackedWeight):
        return [w] + [dataclasses.replace(w, data=huge_copy(w.data)) for _ in range(count - 1)]
    return [w] + [huge_copy(w) for _ in range(count - 1)]


def raw_call(x: torch.Tensor, w: quant.QuantWeight, out: torch.Tensor, flags: int = 0) -> tuple:
    """Arguments of cpud_quant_gemm for fp32 x [M, K] -> out [M, N] (no wrapper overhead)."""
    isa = native.ISAS.index(native.isa())
    m, k = x.shape
    code = quant.QTYPES[w.qtype][0]
    ptrs = (w.qs.data_ptr(), w.sc.data_ptr(), 0, out.data_ptr(), 0, w.n, m, w.n, k)
    return (isa, flags, code, x.data_ptr(), 0, k, *ptrs)


def gemv_row(name: str, layer: str, n: int, k: int, args: argparse.Namespace, probe: Any) -> dict:
    rng = np.random.default_rng(0)
    qw = quant.pack_quantized(random_rows(name, n, k, rng), name, n, k)
    pool = args.pool_mb << 20
    qws = copies_of(qw, qw.weight_bytes, pool)
    wb = torch.randn(n, k).to(torch.bfloat16)
    bfs = copies_of(wb, n * k * 2, pool)
    kern = Kernels(native.isa())
    pws = copies_of(native.pack_weight(wb), n * k * 2, pool)
    x = torch.randn(1, k)
    xb = x.to(torch.bfloat16)
    out = torch.empty(1, n)
    outb = torch.empty(1, n, dtype=torch.bfloat16)
    quant.quant_gemm(x, qw, out)  # the checked path once; the timed loop calls C directly
    lib = native._loader.lib
    raw_args = [raw_call(x, w, out) for w in qws]
    runs = {
        "probe": (lambda: probe(), probe.bytes),
        "quant": (lambda: [lib.cpud_quant_gemm(*a) for a in raw_args], qw.gguf_bytes * len(qws)),
        "torch_bf16": (lambda: [F.linear(xb, w) for w in bfs], n * k * 2 * len(bfs)),
        "cpud_bf16": (lambda: [kern.gemm_packed(xb, w, outb) for w in pws], n * k * 2 * len(pws)),
    }
    for fn, _ in runs.values():
        fn()
    gbs: dict[str, list[float]] = {key: [] for key in runs}
    for _ in range(args.reps):
        for key, (fn, nbytes) in runs.items():
            gbs[key].append(nbytes / timed(fn) / 1e9)
    med = {key: statistics.median(v) for key, v in gbs.items()}
    ratios = [q / p for q, p in zip(gbs["quant"], gbs["probe"])]
    return {
        "format": name,
        "layer": layer,
        "n": n,
        "k": k,
        "m": 1,
        "gbs": med,
        "best_gbs": {key: max(v) for key, v in gbs.items()},
        "in_cache_gbs": in_cache_gbs(name, n, k, args),
        "quant_vs_probe": statistics.median(ratios),
        # call time of cpud's bf16 GEMV over the quantized one's
        "speedup_vs_cpud_bf16": (n * k * 2 / med["cpud_bf16"]) / (qw.gguf_bytes / med["quant"]),
        "tok_s_equiv": med["quant"] * 1e9 / qw.gguf_bytes,
    }


def in_cache_gbs(name: str, n: int, k: int, args: argparse.Namespace) -> float:
    """GGUF GB/s of M=1 calls on one weight of the shape's first rows that fits --cache-kb per
    thread, called repeatedly: the fastest of --reps rounds of ~0.2 GB each."""
    _, bs, tsize, _, _ = quant.QTYPES[name]
    row_bytes = k // bs * tsize
    rows = min(n, max(32, (args.cache_kb << 10) * args.threads // row_bytes // 32 * 32))
    qw = quant.pack_quantized(random_rows(name, rows, k, np.random.default_rng(2)), name, rows, k)
    x, out = torch.randn(1, k), torch.empty(1, rows)
    quant.quant_gemm(x, qw, out)
    lib, a = native._loader.lib, raw_call(x, qw, out)
    calls = max(10, int(2e8 // qw.gguf_bytes))
    for _ in range(calls // 10):
        lib.cpud_quant_gemm(*a)
    best = 0.0
    for _ in range(args.reps):
        t = timed(lambda: [lib.cpud_quant_gemm(*a) for _ in range(calls)])
        best = max(best, qw.gguf_bytes * calls / t / 1e9)
    return best


def gemm_rows(
    name: str, layer: str, n: int, k: int, m: int, args: argparse.Namespace, peaks: dict
) -> list[dict]:
    """One row per kernel path at m rows, timed in the same interleaved rounds."""
    rng = np.random.default_rng(1)
    qw = quant.pack_quantized(random_rows(name, n, k, rng), name, n, k)
    wb = torch.randn(n, k).to(torch.bfloat16)
    pw = native.pack_weight(wb)
    kern = Kernels(native.isa())
    x = torch.randn(m, k)
    xb = x.to(torch.bfloat16)
    out, outb = torch.empty(m, n), torch.empty(m, n, dtype=torch.bfloat16)
    calls = max(1, int(2e9 // (2 * m * n * k)))
    quant.quant_gemm(x, qw, out)
    lib, paths = native._loader.lib, kernel_paths(name, m)
    runs: dict[str, Callable[[], object]] = {}
    for label, (flags, _) in paths.items():
        a = raw_call(x, qw, out, flags)
        runs[label] = lambda a=a: [lib.cpud_quant_gemm(*a) for _ in range(calls)]
    runs["torch_bf16"] = lambda: [F.linear(xb, wb) for _ in range(calls)]
    runs["cpud_bf16"] = lambda: [kern.gemm_packed(xb, pw, outb) for _ in range(calls)]
    for fn in runs.values():
        fn()
    gops: dict[str, list[float]] = {key: [] for key in runs}
    for _ in range(args.reps):
        for key, fn in runs.items():
            gops[key].append(2 * m * n * k * calls / timed(fn) / 1e9)
    med = {key: statistics.median(v) for key, v in gops.items()}
    rows = []
    for label, (_, peak_kernel) in paths.items():
        rows.append(
            {
                "format": name,
                "layer": layer,
                "n": n,
                "k": k,
                "m": m,
                "kernel": label,
                "gops": {
                    "quant": med[label],
                    "torch_bf16": med["torch_bf16"],
                    "cpud_bf16": med["cpud_bf16"],
                },
                "quant_vs_int8_peak": med[label] / peaks[peak_kernel] if peak_kernel else None,
                "quant_vs_cpud_bf16": med[label] / med["cpud_bf16"],
            }
        )
    return rows


def kernel_paths(name: str, m: int) -> dict[str, tuple[int, str | None]]:
    """label -> (cpud_quant_gemm flags, kernel whose int8 peak applies or None) of each
    distinct path quant_gemm can take for m rows of name here (default flags first)."""
    paths: dict[str, tuple[int, str | None]] = {}
    for flags, amx, amx_bf16 in (
        (0, True, True),
        (quant.NO_AMX_BF16, True, False),
        (quant.NO_AMX, False, True),
    ):
        rows = quant.bf16_tile_rows(name, amx=amx, amx_bf16=amx_bf16)
        if rows is not None and m >= rows:
            label, peak = "amx-bf16 tiles (dequantized groups)", None
        else:
            kernel = quant.quant_kernel(amx=amx, amx_bf16=False)
            if m < 16 and "amx-int8" in kernel:
                kernel = quant.quant_kernel(amx=False)
            label, peak = kernel, kernel
        paths.setdefault(label, (flags, peak))
    return paths


class ReadProbe:
    def __init__(self, nbytes: int) -> None:
        self.buf = huge_copy(torch.randint(0, 255, (nbytes,), dtype=torch.uint8))
        self.bytes = nbytes
        self.kern = Kernels("avx512" if "avx512" in native.supported_isas() else native.isa())

    def __call__(self) -> int:
        return self.kern.read_probe(self.buf)


def huge_share(t: torch.Tensor) -> float | None:
    """Share of t's bytes on transparent huge pages (the kernel's AnonHugePages of the mapping
    that holds t), or None where /proc/self/smaps cannot tell."""
    addr, mapping = t.data_ptr(), None
    try:
        for line in Path("/proc/self/smaps").read_text().splitlines():
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                mapping = (lo, hi) if lo <= addr < hi else None
            elif mapping and head == "AnonHugePages:":
                return min(1.0, int(line.split()[1]) * 1024 / (t.numel() * t.element_size()))
    except (OSError, ValueError):
        pass
    return None


def int8_peaks(reps: int) -> dict[str, float]:
    """GOP/s of the int8 compute probe of each kernel this tier runs, median of reps."""
    peaks = {}
    for amx in (False, True):
        iters = 2_000_000 if not amx else 200_000
        quant.quant_compute_probe(iters // 10, amx=amx)
        peaks[quant.quant_kernel(amx=amx, amx_bf16=False)] = statistics.median(
            probe_gops(iters, amx) for _ in range(reps)
        )
    return peaks


def probe_gops(iters: int, amx: bool) -> float:
    t0 = time.perf_counter()
    ops = quant.quant_compute_probe(iters, amx=amx)
    return ops / (time.perf_counter() - t0) / 1e9


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def run_record(script: str) -> dict[str, Any]:
    """The head of a bench's JSON record: its command line, UTC time, CPU and ISA tier."""
    return {
        "command": f"python3 perf/{script} " + " ".join(sys.argv[1:]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "isa": native.isa(),
    }


def save_record(result: dict[str, Any], out: Path | None, stem: str) -> Path:
    """Write a bench's JSON record to `out`, or perf/results/<stem>_<isa>.json; say where."""
    out = out or Path(__file__).parent / "results" / f"{stem}_{result['isa']}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--pool-mb", type=int, default=1024)
    ap.add_argument("--cache-kb", type=int, default=512)
    ap.add_argument("--formats", nargs="+", default=list(quant.QTYPES))
    ap.add_argument("--batches", nargs="+", type=int, default=[32, 64, 512])
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    probe = ReadProbe((args.pool_mb << 20) // 4096 * 4096)
    peaks = int8_peaks(args.reps)
    share = huge_share(probe.buf)
    print(
        f"kernel {quant.quant_kernel()} (tier {native.isa()}), {args.threads} threads, "
        "int8 peak "
        + ", ".join(f"{k} {v:.0f} GOP/s" for k, v in peaks.items())
        + f", probe {probe.bytes >> 20} MiB, "
        + ("huge pages unknown" if share is None else f"{share:.0%} on huge pages")
    )
    rows = []
    print(
        "| format | layer | N x K | M | quant GB/s | probe GB/s | quant/probe | best quant / probe "
        "| in cache GB/s | torch bf16 GB/s | cpud bf16 GB/s | speedup vs cpud bf16 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.formats:
        for layer, n, k in SHAPES:
            if layer == "lm_head" and name not in LM_HEAD_FORMATS:
                continue
            r = gemv_row(name, layer, n, k, args, probe)
            rows.append(r)
            g, b = r["gbs"], r["best_gbs"]
            print(
                f"| {name} | {layer} | {n} x {k} | 1 | {g['quant']:.1f} | {g['probe']:.1f} | "
                f"{r['quant_vs_probe']:.0%} | {b['quant']:.1f} / {b['probe']:.1f} | "
                f"{r['in_cache_gbs']:.1f} | {g['torch_bf16']:.1f} | {g['cpud_bf16']:.1f} | "
                f"{r['speedup_vs_cpud_bf16']:.2f}x |"
            )
    print()
    print(
        "| format | layer | N x K | M | kernel | quant GOP/s | of int8 peak "
        "| torch bf16 GFLOP/s | cpud bf16 GFLOP/s | quant / cpud bf16 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.formats:
        for layer, n, k in SHAPES[:-1]:
            for m in args.batches:
                for r in gemm_rows(name, layer, n, k, m, args, peaks):
                    rows.append(r)
                    g = r["gops"]
                    peak = r["quant_vs_int8_peak"]
                    print(
                        f"| {name} | {layer} | {n} x {k} | {m} | {r['kernel']} | "
                        f"{g['quant']:.0f} | {'-' if peak is None else f'{peak:.0%}'} | "
                        f"{g['torch_bf16']:.0f} | {g['cpud_bf16']:.0f} | "
                        f"{r['quant_vs_cpud_bf16']:.2f}x |"
                    )
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    meta = {
        "cpu": cpu_model(),
        "isa": native.isa(),
        "kernel": quant.quant_kernel(),
        "threads": args.threads,
        "int8_peak_gops": peaks,
        "probe_bytes": probe.bytes,
        "probe_huge_page_share": share,
    }
    path = out / f"quant_kernels-{stamp}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
