"""Skinny-GEMM benchmark: native packed bf16 GEMM vs torch F.linear vs memory read bandwidth.

For each decode layer shape of Qwen3-0.6B and Llama-3.2-1B and each batch M,
the weights are streamed from DRAM: every timed sweep walks a pool of distinct
weight copies much larger than the L3, one call per copy.  A native AVX-512
streaming read over a buffer far larger than L3 (same threads) is measured in
the same run, interleaved with the GEMMs (probe, native, torch, probe, ...),
and every figure is a median over repetitions.  Weight GB/s counts the
unpadded bf16 weight bytes (N * K * 2) per call.

    python perf/bench_kernels.py [--threads 2] [--reps 7] [--batches 1 8] [--peak]
    python perf/bench_kernels.py --attention [--reps 7] [--attn-scenarios prefill-512 ...]

With --peak it also measures two compute limits in the same run, medians of --reps: the
instruction peak (the kernel tier's widest multiply-add in registers on every thread: vdpbf16ps
on avx512bf16, ~450 GFLOP/s on a 2-core Zen 4 EPYC, 154 on a 2-core AMX Xeon; tdpbf16ps on amx,
~2560 on that Xeon) and torch F.linear (oneDNN) at M=512, K=2048, N=8192 (~375 on the EPYC,
~700 on the Xeon, where oneDNN uses AMX too), and reports each native GEMM's GFLOP/s as a
fraction of both.
With --attention it benchmarks native paged attention instead (bf16 KV cache, Qwen3-0.6B layer
shapes: 16 q heads, 8 kv heads, head dim 128, block size 16): one prefill of 512 or 2048 tokens,
and decode of 32 sequences at context 64, 512 or 2048; ms per call (one layer), GFLOP/s counting
the causal score and value matmuls (4 * nh * hd per visible (query, key) pair) and GB/s of keys
and values read, medians of --reps.  Calls go round copies of the KV cache totalling 256 MiB,
so keys and values come from DRAM as in a real step (one layer's cache would sit in the L3).
Prints a Markdown table and writes JSON to perf/results/ (or --out-dir).
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from cpud import native

# (model, layer, N, K): y[M, N] = x[M, K] @ W[N, K]^T, bf16 weights, TP = 1.
SHAPES: dict[str, list[tuple[str, int, int]]] = {
    # hidden 1024, 16 q heads x 128, 8 kv heads x 128, intermediate 3072
    "qwen3-0.6b": [
        ("qkv", 16 * 128 + 2 * 8 * 128, 1024),
        ("o", 1024, 2048),
        ("gate_up", 2 * 3072, 1024),
        ("down", 1024, 3072),
    ],
    # hidden 2048, 32 q heads x 64, 8 kv heads x 64, intermediate 8192
    "llama-3.2-1b": [
        ("qkv", 32 * 64 + 2 * 8 * 64, 2048),
        ("o", 2048, 2048),
        ("gate_up", 2 * 8192, 2048),
        ("down", 2048, 8192),
    ],
}


@dataclass
class Row:
    model: str
    layer: str
    n: int
    k: int
    m: int
    weight_bytes: int
    copies: int
    probe_gbs: float
    native_gbs: float
    torch_gbs: float
    native_gflops: float
    torch_gflops: float
    native_vs_probe: float
    best_native_vs_best_probe: float
    native_vs_torch: float
    samples: dict[str, list[float]] = field(default_factory=dict)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def sweep_native(
    kern: native.Kernels, x: torch.Tensor, packed: list[native.PackedWeight], out: torch.Tensor
) -> None:
    for p in packed:
        kern.gemm_packed(x, p, out)


def sweep_torch(x: torch.Tensor, weights: list[torch.Tensor]) -> None:
    for w in weights:
        F.linear(x, w)


def bench_shape(
    kern: native.Kernels,
    probe: torch.Tensor,
    model: str,
    layer: str,
    n: int,
    k: int,
    batches: list[int],
    reps: int,
    pool_bytes: int,
) -> list[Row]:
    wbytes = n * k * 2
    copies = max(2, -(-pool_bytes // wbytes))
    weights = [torch.randn(n, k).to(torch.bfloat16) for _ in range(copies)]
    packed = [native.pack_weight(w) for w in weights]
    rows = []
    for m in batches:
        x = torch.randn(m, k).to(torch.bfloat16)
        out = torch.empty(m, n, dtype=torch.bfloat16)

        run_native = functools.partial(sweep_native, kern, x, packed, out)
        run_torch = functools.partial(sweep_torch, x, weights)
        run_native()  # warm-up (page faults, oneDNN primitive creation)
        run_torch()
        s: dict[str, list[float]] = {"probe": [], "native": [], "torch": []}
        for _ in range(reps):
            s["probe"].append(probe.numel() / timed(lambda: kern.read_probe(probe)) / 1e9)
            s["native"].append(copies * wbytes / timed(run_native) / 1e9)
            s["torch"].append(copies * wbytes / timed(run_torch) / 1e9)
        med = {key: statistics.median(v) for key, v in s.items()}
        ratio = statistics.median(a / b for a, b in zip(s["native"], s["probe"]))
        flops_per_byte = 2 * m * n * k / wbytes
        rows.append(
            Row(
                model=model,
                layer=layer,
                n=n,
                k=k,
                m=m,
                weight_bytes=wbytes,
                copies=copies,
                probe_gbs=med["probe"],
                native_gbs=med["native"],
                torch_gbs=med["torch"],
                native_gflops=med["native"] * flops_per_byte,
                torch_gflops=med["torch"] * flops_per_byte,
                native_vs_probe=ratio,
                best_native_vs_best_probe=max(s["native"]) / max(s["probe"]),
                native_vs_torch=statistics.median(a / b for a, b in zip(s["native"], s["torch"])),
                samples=s,
            )
        )
    return rows


PEAK_SHAPE = (512, 2048, 8192)  # M, K, N: large enough to be compute bound with oneDNN


def bf16_peak_gflops(reps: int) -> dict[str, float | list[float]]:
    """torch bf16 F.linear at PEAK_SHAPE: the machine's practical bf16 matmul peak."""
    m, k, n = PEAK_SHAPE
    x = torch.randn(m, k).to(torch.bfloat16)
    w = torch.randn(n, k).to(torch.bfloat16)
    for _ in range(3):  # warm-up: oneDNN primitive creation, page faults
        F.linear(x, w)
    calls = 4
    samples = [
        calls * 2 * m * n * k / timed(lambda: [F.linear(x, w) for _ in range(calls)]) / 1e9
        for _ in range(reps)
    ]
    return {"m": m, "k": k, "n": n, "gflops": statistics.median(samples), "samples": samples}


def instruction_peak_gflops(kern: native.Kernels, reps: int) -> dict[str, float | list[float]]:
    """The tier's register multiply-add loop on every thread (kern.compute_probe), ~0.1 s a
    sample: what no kernel of this tier can beat."""
    kern.compute_probe(1 << 20)  # warm-up: the parallel region's threads
    iters = max(1, round((1 << 20) * 0.1 / timed(lambda: kern.compute_probe(1 << 20))))
    samples = []
    for _ in range(reps):
        started = time.perf_counter()
        flops = kern.compute_probe(iters)
        samples.append(flops / (time.perf_counter() - started) / 1e9)
    return {"iters": iters, "gflops": statistics.median(samples), "samples": samples}


# name -> [(context incl. this step, query tokens)] per sequence
ATTN_SCENARIOS: dict[str, list[tuple[int, int]]] = {
    "prefill-512": [(512, 512)],
    "prefill-2048": [(2048, 2048)],
    "decode-32x64": [(64, 1)] * 32,
    "decode-32x512": [(512, 1)] * 32,
    "decode-32x2048": [(2048, 1)] * 32,
}
ATTN_HEADS = (16, 8, 128, 16)  # nh, nkv, hd, block size: Qwen3-0.6B, cpud's default block
ATTN_POOL_BYTES = 256 << 20  # KV copies per scenario, far beyond the L3


def repeat(fn: Callable[[], object], n: int) -> None:
    for _ in range(n):
        fn()


def attention_case(seqs: list[tuple[int, int]], nh: int, nkv: int, hd: int, bs: int) -> tuple:
    """Random bf16 query and paged KV cache for seqs, blocks in shuffled order."""
    nblk = [-(-ctx // bs) for ctx, _ in seqs]
    perm = torch.randperm(sum(nblk), dtype=torch.int32)
    bt = torch.zeros(len(seqs), max(nblk), dtype=torch.int32)
    used = 0
    for s, n in enumerate(nblk):
        bt[s, :n] = perm[used : used + n]
        used += n
    kc = torch.randn(sum(nblk), nkv, bs, hd).to(torch.bfloat16)
    vc = torch.randn(sum(nblk), nkv, bs, hd).to(torch.bfloat16)
    q_lens = [q for _, q in seqs]
    q = torch.randn(sum(q_lens), nh, hd).to(torch.bfloat16)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32)
    return q, kc, vc, qsl, seq_lens, bt


def attention_flops(seqs: list[tuple[int, int]], nh: int, hd: int) -> int:
    """Score and value matmul FLOPs over the visible (query, key) pairs (causal)."""
    pairs = sum(q * (ctx - q) + q * (q + 1) // 2 for ctx, q in seqs)
    return 4 * nh * hd * pairs


def bench_attention(kern: native.Kernels, names: list[str], reps: int) -> list[dict]:
    nh, nkv, hd, bs = ATTN_HEADS
    rows = []
    for name in names:
        seqs = ATTN_SCENARIOS[name]
        # Copies of the KV cache, called in turn, totalling >= ATTN_POOL_BYTES: every call
        # reads its keys and values from DRAM, as a decode step over 28 layers does.
        kv_bytes = sum(ctx for ctx, _ in seqs) * nkv * hd * 2 * 2
        copies = max(1, -(-ATTN_POOL_BYTES // kv_bytes))
        cases = [attention_case(seqs, nh, nkv, hd, bs) for _ in range(copies)]
        out = torch.empty_like(cases[0][0])
        scale = hd**-0.5
        calls = [functools.partial(kern.paged_attention, *c, scale, out=out) for c in cases]

        def sweep(calls: list[Callable[[], object]] = calls) -> None:
            for call in calls:
                call()

        sweep()  # warm-up
        sweeps = max(1, round(0.05 / max(timed(sweep), 1e-6)))  # >= ~50 ms per sample
        batch = functools.partial(repeat, sweep, sweeps)
        samples = [timed(batch) / (sweeps * copies) for _ in range(reps)]
        ms = statistics.median(samples) * 1e3
        flops = attention_flops(seqs, nh, hd)
        rows.append(
            {
                "scenario": name,
                "seqs": len(seqs),
                "context": seqs[0][0],
                "query_tokens": sum(q for _, q in seqs),
                "ms": ms,
                "gflops": flops / ms / 1e6,
                "kv_gbs": kv_bytes / ms / 1e6,
                "samples_ms": [t * 1e3 for t in samples],
            }
        )
        print(
            f"# attention {name}: {ms:.3f} ms, {flops / ms / 1e6:.1f} GFLOP/s, "
            f"KV {kv_bytes / ms / 1e6:.1f} GB/s"
        )
    return rows


def markdown_attention(rows: list[dict]) -> str:
    head = (
        "| scenario | seqs | context | query tokens | ms | GFLOP/s | KV GB/s |\n"
        "|---|---:|---:|---:|---:|---:|---:|\n"
    )
    body = "".join(
        f"| {r['scenario']} | {r['seqs']} | {r['context']} | {r['query_tokens']} "
        f"| {r['ms']:.3f} | {r['gflops']:.1f} | {r['kv_gbs']:.1f} |\n"
        for r in rows
    )
    return head + body


def markdown(rows: list[Row]) -> str:
    head = (
        "| model | layer | N | K | M | probe GB/s | native GB/s | native/probe | best/best "
        "| torch GB/s | native/torch | native GFLOP/s |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    body = "".join(
        f"| {r.model} | {r.layer} | {r.n} | {r.k} | {r.m} | {r.probe_gbs:.1f} "
        f"| {r.native_gbs:.1f} | {r.native_vs_probe:.0%} | {r.best_native_vs_best_probe:.0%} "
        f"| {r.torch_gbs:.1f} "
        f"| {r.native_vs_torch:.2f}x | {r.native_gflops:.0f} |\n"
        for r in rows
    )
    return head + body


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--isa", default=None, help="kernel tier (default: cpud.native.isa())")
    ap.add_argument("--pool-mib", type=int, default=256, help="weight copies per shape (>> L3)")
    ap.add_argument("--probe-mib", type=int, default=1024, help="read-probe buffer (>> L3)")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--peak", action="store_true", help="also measure the bf16 matmul peak")
    ap.add_argument("--attention", action="store_true", help="benchmark paged attention instead")
    ap.add_argument(
        "--attn-scenarios", nargs="+", default=list(ATTN_SCENARIOS), choices=list(ATTN_SCENARIOS)
    )
    args = ap.parse_args()

    if not native.available():
        raise SystemExit(f"native kernels not available: {native.load_error()}")
    torch.set_num_threads(args.threads)
    kern = native.Kernels(args.isa)
    if args.attention:
        main_attention(kern, args)
        return
    # Random contents: reading constant pages measured ~10% slower here.
    probe = torch.randint(0, 256, (args.probe_mib << 20,), dtype=torch.uint8)
    kern.read_probe(probe)

    load_start = os.getloadavg()
    rows: list[Row] = []
    for model in args.models:
        for layer, n, k in SHAPES[model]:
            rows += bench_shape(
                kern, probe, model, layer, n, k, args.batches, args.reps, args.pool_mib << 20
            )
            r = rows[-len(args.batches)]
            print(f"# {model} {layer}: M={r.m} {r.native_gbs:.1f} GB/s ({r.native_vs_probe:.0%})")

    meta = run_meta(
        kern,
        args,
        load_start,
        torch=torch.__version__,
        pool_mib=args.pool_mib,
        probe_mib=args.probe_mib,
    )
    print(
        f"\n{meta['cpu']}, {args.threads} threads, tier {kern.isa}, torch {torch.__version__}, "
        f"medians of {args.reps} interleaved reps (native/probe: median of per-rep ratios; "
        f"best/best: fastest native over fastest probe); load average "
        f"{load_start[0]:.2f} -> {meta['loadavg_end'][0]:.2f}\n"
    )
    print(markdown(rows))
    if args.peak:
        peak = bf16_peak_gflops(args.reps)
        meta["bf16_peak"] = peak
        isa_peak = instruction_peak_gflops(kern, args.reps)
        meta["instruction_peak"] = isa_peak
        print(
            f"instruction peak (tier {kern.isa}, register multiply-adds): "
            f"{isa_peak['gflops']:.0f} GFLOP/s; bf16 matmul peak (torch F.linear, M,K,N = "
            f"{PEAK_SHAPE}): {peak['gflops']:.0f} GFLOP/s"
        )
        for r in rows:
            print(
                f"  {r.model} {r.layer} M={r.m}: native {r.native_gflops:.0f} GFLOP/s = "
                f"{r.native_gflops / isa_peak['gflops']:.0%} of the instruction peak, "
                f"{r.native_gflops / peak['gflops']:.0%} of torch's"
            )
    write_results(args.out_dir, "bench_kernels", meta, [asdict(r) for r in rows])


def run_meta(
    kern: native.Kernels, args: argparse.Namespace, load_start: tuple[float, ...], **extra: Any
) -> dict[str, Any]:
    """What a results file says about its run: when, where, which tier, how loaded."""
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "threads": args.threads,
        "isa": kern.isa,
        **extra,
        "reps": args.reps,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
    }


def write_results(out_dir: Path, prefix: str, meta: dict[str, Any], rows: list[Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = out_dir / f"{prefix}-{stamp}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {path}")


def main_attention(kern: native.Kernels, args: argparse.Namespace) -> None:
    load_start = os.getloadavg()
    rows = bench_attention(kern, args.attn_scenarios, args.reps)
    heads = dict(zip(("nh", "nkv", "hd", "block_size"), ATTN_HEADS))
    meta = run_meta(kern, args, load_start, native=native.__file__, heads=heads)
    print(
        f"\n{meta['cpu']}, {args.threads} threads, tier {kern.isa}, paged attention bf16, "
        f"nh/nkv/hd/bs = {ATTN_HEADS}, medians of {args.reps}; load average "
        f"{load_start[0]:.2f} -> {meta['loadavg_end'][0]:.2f}\n"
    )
    print(markdown_attention(rows))
    write_results(args.out_dir, "bench_attention", meta, rows)


if __name__ == "__main__":
    main()
