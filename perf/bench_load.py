"""Repacking a GGUF file's quantized expert stacks (the first start's cost before the weight
cache exists): per stack, the native repack into pre-touched memory (the repack itself), the
first touch of fresh huge-page output, and their sum (as a load pays it).

    python3 perf/bench_load.py FILE.gguf [--threads N]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from cpud.model.gguf_file import open_gguf
from cpud.native.hugepages import huge_empty
from cpud.native.moe_kernels import quant_stack, quant_stack_shapes
from cpud.native.quant_formats import KERNEL_FORMATS


def stacks(path: str) -> list[tuple[str, list[np.ndarray], str, int, int]]:
    """(name, per-expert [rows, bytes] views, type, n, k) of every quantized expert tensor."""
    out = []
    for t in open_gguf(path).tensors:
        qtype = t.tensor_type.name
        if "_exps" not in t.name or qtype not in KERNEL_FORMATS:
            continue
        experts, n, k = (int(d) for d in reversed(t.shape))
        raw = t.data.view(np.uint8).reshape(experts, n, -1)
        out.append((t.name, [raw[e] for e in range(experts)], qtype, n, k))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gguf_bytes = pack_s = touch_s = 0.0
    for name, rows, qtype, n, k in stacks(args.path):
        shapes = quant_stack_shapes(qtype, len(rows), n, k)
        t0 = time.perf_counter()
        out = tuple(huge_empty(s, torch.uint8) for s in shapes)
        for o in out:
            o.view(-1)[::4096].fill_(0)
        t1 = time.perf_counter()
        quant_stack(rows, qtype, n, k, out=out)
        t2 = time.perf_counter()
        touch_s, pack_s = touch_s + t1 - t0, pack_s + t2 - t1
        gguf_bytes += sum(r.nbytes for r in rows)
        print(f"{name:28s} {qtype:6s} {len(rows)} x [{n}, {k}]: pack {t2 - t1:6.3f} s")
    if not gguf_bytes:
        raise SystemExit(f"{args.path}: no quantized expert stacks to repack")
    print(
        f"{gguf_bytes / 2**30:.2f} GiB of blocks on {args.threads} threads: repack {pack_s:.2f} s "
        f"({gguf_bytes / pack_s / 1e9:.2f} GB/s), first touch of the output {touch_s:.2f} s"
    )


if __name__ == "__main__":
    main()
