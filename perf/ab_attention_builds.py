"""Paged attention alone (cpud_paged_attention, the per-op entry point) of two or more builds of
the native library in one process, call by call: decode of S streams at depth D (Q queries each:
Q > 1 is a speculative verification) over a bf16 cache of random rows, builds in turn A, B, B,
A, ... so each runs in the same seconds of the host's read rate. Reports each build's median
time, the rate it reads K and V at, its ratio to the first build and its largest difference
from the first build's output.

    python3 perf/ab_attention_builds.py --streams 1 --depth 8192 --heads 4 --kv-heads 1 \\
        --head-dim 256 --build before=/tmp/old.so --build after=native/_cpud_native.abi3.so
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from ab_native_builds import load_build

from cpud import native

BF16 = 1  # cpud_dtype / cpud_kv_dtype code of bf16 (cpud_native.h)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", action="append", required=True, help="TAG=path of a .so")
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--depth", type=int, default=4096)
    ap.add_argument("--queries", type=int, default=1, help="queries a stream (its last at depth)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--window", type=int, default=0, help="sliding window (0: none)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--calls", type=int, default=60, help="calls per build")
    args = ap.parse_args()
    builds = {}
    for spec in args.build:
        tag, _, path = spec.partition("=")
        builds[tag] = load_build(Path(path), tag)
    S, D, nh, nkv, hd, bs = (
        args.streams,
        args.depth,
        args.heads,
        args.kv_heads,
        args.head_dim,
        args.block_size,
    )
    g = torch.Generator().manual_seed(0)
    per_seq = math.ceil(D / bs)
    nb = S * per_seq
    kc = torch.randn(nb, nkv, bs, hd, generator=g).bfloat16()
    vc = torch.randn(nb, nkv, bs, hd, generator=g).bfloat16()
    Q = args.queries
    q = torch.randn(S * Q, nh, hd, generator=g).bfloat16()
    bt = torch.randperm(nb, generator=g).to(torch.int32).reshape(S, per_seq)
    qsl = torch.arange(S + 1, dtype=torch.int32) * Q
    seq_lens = torch.full((S,), D, dtype=torch.int32)
    isa = native.ISAS.index(native.default_isa())
    ns: dict[str, list[int]] = {tag: [] for tag in builds}
    outs: dict[str, torch.Tensor] = {}
    tags = list(builds)

    def call(tag: str) -> None:
        ffi, lib = builds[tag]
        out = torch.empty_like(q)

        def ptr(t: torch.Tensor) -> Any:
            return ffi.cast("intptr_t", t.data_ptr())

        t0 = time.perf_counter_ns()
        rc = lib.cpud_paged_attention(
            isa, BF16, BF16, ptr(q), nh * hd, ptr(kc), ptr(vc), ptr(qsl), ptr(seq_lens), ptr(bt),
            per_seq, ptr(out), nh * hd, S * Q, S, nh, nkv, hd, nb, bs, hd**-0.5, args.window, 0, 0,
        )  # fmt: skip
        ns[tag].append(time.perf_counter_ns() - t0)
        if rc:
            raise SystemExit(f"{tag}: cpud_paged_attention returned {rc}")
        outs[tag] = out

    for i in range(args.calls):
        for tag in tags if i % 2 == 0 else tags[::-1]:
            call(tag)
    keys = min(D, args.window + Q - 1) if args.window else D
    gb = 2 * S * keys * nkv * hd * 2 / 1e9
    first = statistics.median(ns[tags[0]][5:])
    window = f", window {args.window}" if args.window else ""
    print(f"{S} stream(s) of {Q} quer(ies) at depth {D}{window}, {nh} / {nkv} heads of {hd}")
    for tag in tags:
        m = statistics.median(ns[tag][5:])
        diff = (outs[tag].float() - outs[tags[0]].float()).abs().max().item()
        print(
            f"{tag}: {m / 1e6:.3f} ms, K and V read at {gb / m * 1e9:.1f} GB/s, "
            f"{first / m:.3f}x {tags[0]}, largest difference from it {diff:.3g}"
        )


if __name__ == "__main__":
    main()
