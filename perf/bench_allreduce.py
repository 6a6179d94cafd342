"""All-reduce latency between 2 rank processes: cpud shared memory vs gloo.

Both collectives run in the same two processes (spawned, one torch thread
each, pinned to CPUs 0 and 1 unless --no-pin), interleaved per size
(shm block, gloo block, shm block, ...), each block preceded by a barrier.
Every call is timed on rank 0; the figure is the median (and p90) over all
calls.  The "sync floor" is the median of an empty shm barrier: one
cross-core handshake, the least any all-reduce here can cost.  gloo uses
torch.distributed with a file:// rendezvous in a private temp dir.

    python perf/bench_allreduce.py [--reps 3] [--dtype bfloat16] [--no-pin]

Prints a Markdown table and writes JSON to perf/results/allreduce.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import multiprocessing as mp
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cpud import native
from cpud.native import ShmGroup

WORLD = 2
SIZES = {"2 KiB": 2 << 10, "64 KiB": 64 << 10, "1 MiB": 1 << 20}
CALLS = {2 << 10: 400, 64 << 10: 200, 1 << 20: 40}  # per block
WARMUP = 10


def _time_calls(fn: Callable[[], object], calls: int) -> list[float]:
    """Seconds per call, each timed on its own."""
    out = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) * 1e-9)
    return out


def _stats(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_us": statistics.median(ordered) * 1e6,
        "p90_us": ordered[int(0.9 * (len(ordered) - 1))] * 1e6,
        "calls": len(ordered),
    }


def _rank_main(rank: int, shm_path: str, rdv: str, args: dict[str, Any], out: str) -> None:
    """One rank: both collectives, interleaved; rank 0 writes the samples to out."""
    if args["pin"]:
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    dtype = getattr(torch, args["dtype"])
    group = ShmGroup.attach(shm_path, rank, WORLD)
    dist.init_process_group("gloo", init_method=rdv, rank=rank, world_size=WORLD)
    group.barrier(timeout=60.0)
    samples: dict[str, dict[str, list[float]]] = {}
    floor: list[float] = []
    agree = True
    for label, nbytes in SIZES.items():
        numel = nbytes // torch.empty(0, dtype=dtype).element_size()
        a, b = torch.randn(numel).to(dtype), torch.randn(numel).to(dtype)
        b.copy_(a)
        group.all_reduce(a)
        dist.all_reduce(b)
        agree = agree and torch.equal(a, b)
        x = torch.zeros(numel, dtype=dtype)  # sums of zeros stay zero: no overflow, no denormals
        fns = {
            "shm": functools.partial(group.all_reduce, x),
            "gloo": functools.partial(dist.all_reduce, x),
        }
        per = samples.setdefault(label, {"shm": [], "gloo": []})
        for _ in range(args["reps"]):
            for name, fn in fns.items():
                _time_calls(fn, WARMUP)
                group.barrier()
                per[name] += _time_calls(fn, CALLS[nbytes])
            group.barrier()
            floor += _time_calls(group.barrier, 200)
    dist.barrier()
    if rank == 0:
        result = {"samples": samples, "floor": floor, "agree": agree}
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()
    group.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="cpud-bench-") as tmp:
        os.chmod(tmp, 0o700)
        shm_path = f"/dev/shm/cpud-bench-{os.getpid()}"
        owner = ShmGroup.create(shm_path, WORLD, max(SIZES.values()))
        out = os.path.join(tmp, "result.json")
        opts = {"pin": args.pin, "dtype": args.dtype, "reps": args.reps}
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=_rank_main, args=(r, shm_path, f"file://{tmp}/rdv", opts, out))
            for r in range(WORLD)
        ]
        try:
            for p in procs:
                p.start()
            for p in procs:
                p.join(600)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            owner.unlink()
            owner.close()
        if any(p.exitcode != 0 for p in procs):
            raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        raw = json.loads(Path(out).read_text())
    rows = []
    for label, per in raw["samples"].items():
        shm, gloo = _stats(per["shm"]), _stats(per["gloo"])
        rows.append(
            {
                "size": label,
                "bytes": SIZES[label],
                "shm": shm,
                "gloo": gloo,
                "speedup": gloo["median_us"] / shm["median_us"],
            }
        )
    return {
        "rows": rows,
        "sync_floor": _stats(raw["floor"]),
        "results_equal_shm_gloo": raw["agree"],
        "config": {
            "world": WORLD,
            "dtype": args.dtype,
            "reps": args.reps,
            "pinned": args.pin,
            "threads_per_rank": 1,
            "isa": native.isa(),
        },
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "loadavg_after": os.getloadavg(),
        },
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def markdown(res: dict[str, Any]) -> str:
    cfg = res["config"]
    lines = [
        f"All-reduce, {cfg['world']} processes, {cfg['dtype']}, 1 thread each"
        f"{', pinned' if cfg['pinned'] else ''} (median / p90 per call, rank 0)",
        "",
        "| size | shm median | shm p90 | gloo median | gloo p90 | gloo / shm |",
        "|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        s, g = r["shm"], r["gloo"]
        lines.append(
            f"| {r['size']} | {s['median_us']:.1f} us | {s['p90_us']:.1f} us | "
            f"{g['median_us']:.1f} us | {g['p90_us']:.1f} us | {r['speedup']:.1f}x |"
        )
    f = res["sync_floor"]
    lines += ["", f"sync floor (empty shm barrier): {f['median_us']:.2f} us median"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="interleaved shm/gloo rounds per size")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin ranks")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results/allreduce.json")
    args = ap.parse_args()
    if not native.available():
        raise SystemExit(f"native library not available: {native.load_error()}")
    res = run(args)
    print(markdown(res))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
