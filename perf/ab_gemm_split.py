"""Paired A/B of the packed bf16 GEMM: a baseline build of the native library against this tree's.

Both libraries are loaded into one process and called in turns (A, B, A, B, ...) on the same
weights, inputs and threads, so drift in the machine's state hits both sides alike.  Every call
of a timed sweep walks a pool of weight copies larger than the L3 (weights come from memory, as
in decode).  Each case also checks that both builds return bit-identical outputs.

    git worktree add /tmp/base <commit before the change>
    (cd /tmp/base && python native/build_native.py)
    python perf/ab_gemm_split.py --base /tmp/base/native/_cpud_native.abi3.so \
        [--isas avx512bf16 amx] [--batches 1 8 32 128] [--reps 15]

Prints a Markdown table (median ms of each side, paired ratio new/base with its spread) and
writes JSON to perf/results/ (or --out-dir).  Ratios below 1 mean this tree is faster.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from cpud import native
from cpud.native import _loader

# (layer, N, K) of Qwen3-0.6B and Llama-3.2-1B decode layers, TP = 1
SHAPES: list[tuple[str, int, int]] = [
    ("qwen3-0.6b qkv", 4096, 1024),
    ("qwen3-0.6b down", 1024, 3072),
    ("llama-3.2-1b gate_up", 16384, 2048),
    ("llama-3.2-1b down", 2048, 8192),
]
CODES = {torch.float32: 0, torch.bfloat16: 1}


def load_base(path: Path) -> Any:
    """The cffi `lib` of a native library built elsewhere, loaded beside this tree's."""
    loader = importlib.machinery.ExtensionFileLoader("cpud_ab_base._cpud_native", str(path))
    spec = importlib.util.spec_from_file_location(loader.name, str(path), loader=loader)
    if spec is None:
        raise SystemExit(f"error: cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod.lib


def add_ab_args(ap: argparse.ArgumentParser) -> None:
    """The options of every paired A/B script: the baseline library, the tiers, the threads."""
    ap.add_argument("--base", type=Path, required=True, help="baseline _cpud_native*.so")
    ap.add_argument("--isas", nargs="+", default=None, help="tiers (default: all this CPU runs)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())


def start_ab(args: argparse.Namespace) -> tuple[list[str], Any]:
    """Checks add_ab_args' options and sets the threads: (the tiers to run, the baseline lib)."""
    if not native.available():
        raise SystemExit(f"error: native kernels not available: {native.load_error()}")
    if not args.base.is_file():
        raise SystemExit(f"error: --base {args.base} is not a file")
    isas = args.isas or native.supported_isas()
    unknown = [i for i in isas if i not in native.supported_isas()]
    if unknown:
        raise SystemExit(
            f"error: this CPU does not run {unknown}; it runs {native.supported_isas()}"
        )
    torch.set_num_threads(args.threads)
    return isas, load_base(args.base)


def gemm(lib: Any, isa: int, x: torch.Tensor, p: native.PackedWeight, out: torch.Tensor) -> None:
    rc = lib.cpud_gemm_packed(
        isa, x.data_ptr(), CODES[x.dtype], x.stride(0), p.data.data_ptr(), 0, 0,
        out.data_ptr(), CODES[out.dtype], out.stride(0), x.shape[0], p.n, p.k,
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"cpud_gemm_packed returned {rc}")


def sweep(
    lib: Any, isa: int, x: torch.Tensor, pool: list[native.PackedWeight], out: torch.Tensor
) -> float:
    t0 = time.perf_counter()
    for p in pool:
        gemm(lib, isa, x, p, out)
    return (time.perf_counter() - t0) / len(pool)


def case(base: Any, isa: str, n: int, k: int, m: int, pool_mib: int, reps: int) -> dict:
    code = _loader.ISAS.index(isa)
    w = torch.randn(n, k) * 0.05
    copies = max(2, pool_mib * 2**20 // (n * k * 2))
    pool = [native.pack_weight(w) for _ in range(copies)]
    x = torch.randn(m, k).to(torch.bfloat16)
    out_a = torch.empty(m, n, dtype=torch.bfloat16)
    out_b = torch.empty_like(out_a)
    gemm(base, code, x, pool[0], out_a)
    gemm(_loader.lib, code, x, pool[0], out_b)
    identical = bool(torch.equal(out_a.view(torch.int16), out_b.view(torch.int16)))
    sweep(base, code, x, pool, out_a)  # warm both: pages, threads, tile state
    sweep(_loader.lib, code, x, pool, out_b)
    ta, tb = [], []
    for _ in range(reps):
        ta.append(sweep(base, code, x, pool, out_a))
        tb.append(sweep(_loader.lib, code, x, pool, out_b))
    ratios = sorted(b / a for a, b in zip(ta, tb))
    return {
        "isa": isa,
        "n": n,
        "k": k,
        "m": m,
        "copies": copies,
        "identical": identical,
        "base_ms": statistics.median(ta) * 1e3,
        "new_ms": statistics.median(tb) * 1e3,
        "ratio": statistics.median(ratios),
        "ratio_lo": ratios[len(ratios) // 4],
        "ratio_hi": ratios[(3 * len(ratios)) // 4],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_ab_args(ap)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--pool-mib", type=int, default=256, help="weight copies per shape (>> L3)")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    isas, base = start_ab(args)
    rows = []
    print("| isa | layer | N | K | M | base ms | new ms | new/base (IQR) | identical |")
    print("|---|---|---:|---:|---:|---:|---:|---|---|")
    for isa in isas:
        for name, n, k in SHAPES:
            for m in args.batches:
                r = case(base, isa, n, k, m, args.pool_mib, args.reps) | {"layer": name}
                rows.append(r)
                print(
                    f"| {isa} | {name} | {n} | {k} | {m} | {r['base_ms']:.3f} | {r['new_ms']:.3f}"
                    f" | {r['ratio']:.3f} ({r['ratio_lo']:.3f}-{r['ratio_hi']:.3f})"
                    f" | {'yes' if r['identical'] else 'NO'} |",
                    flush=True,
                )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"ab_gemm_split_{time.strftime('%Y%m%d_%H%M%S')}.json"
    meta = {"base": str(args.base), "threads": args.threads, "reps": args.reps}
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {path}")
    if not all(r["identical"] for r in rows):
        raise SystemExit("error: the two builds disagree on some outputs")


if __name__ == "__main__":
    main()
