"""Decode (or prefill) of two or more builds of the native library in one process, step by
step: one model load, the fused decoder's layer call (cpud_decoder_layers) sent to build A, B,
B, A, ... in turn, so every build runs in the same seconds of the host's read rate; the rest of
the step (embedding, LM head, sampling) runs on the installed build.  --streams S: decode steps
of S sequences; --prompt N: each step a new sequence's prompt of N tokens instead; --depth D
(--kv-cache-dtype K): one stream from position D of a cache of K filled with random rows.  Reports
each build's median time of the layer call and the read probe (perf/bench_moe.py's, 1 GiB)
before and after.

--check runs every step on each build from the same inputs instead and reports whether the
layers' outputs (hidden state and residual) are equal bit for bit.

    python3 native/build_native.py   # in each tree, e.g. a git worktree of the revision before
    python3 perf/ab_native_builds.py \\
        --model /tmp/moe-bench/qwen3_moe-qwen3-30b-a3b-6l-Q4_K_M.gguf \\
        --build before=/tmp/old/native/_cpud_native.abi3.so \\
        --build after=native/_cpud_native.abi3.so --steps 192
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from bench_depth import fill_cache, step_meta
from bench_depth import runner as depth_runner
from bench_moe import ReadProbe, runner

from cpud.protocol.step import SeqWork, StepPlan


def load_build(path: Path, tag: str) -> tuple[Any, Any]:
    """The cffi module of one build (ffi, lib), imported under its own package name."""
    spec = importlib.util.spec_from_file_location(f"ab_{tag}._cpud_native", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a native module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ffi, module.lib


class Builds:
    """The fused decoder's layer call routed to one of the builds (`current`), timed."""

    def __init__(self, decoder: Any, builds: dict[str, tuple[Any, Any]]) -> None:
        self.decoder, self.builds = decoder, builds
        self.current = next(iter(builds))
        self.ns: dict[str, list[int]] = {tag: [] for tag in builds}
        self.equal: list[bool] = []

    def turn(self, step: int) -> None:
        """The build of step `step`: A, B, B, A, A, B, ... (each leads as often)."""
        tags = list(self.builds)
        order = tags if (step // len(tags)) % 2 == 0 else tags[::-1]
        self.current = order[step % len(tags)]

    def _cast(self, ffi: Any, pointer: Any, ctype: str) -> Any:
        return ffi.cast(ctype, int(self.decoder._ffi.cast("intptr_t", pointer)))

    def run(self, step: Any) -> None:
        ffi, lib = self.builds[self.current]
        dec = self.decoder
        t0 = time.perf_counter_ns()
        rc = lib.cpud_decoder_layers(
            dec._isa,
            self._cast(ffi, dec._dims, "cpud_decoder_dims *"),
            self._cast(ffi, dec._layers, "cpud_decoder_layer *"),
            len(dec.table.layers),
            self._cast(ffi, step, "cpud_decoder_step *"),
            ffi.NULL,
            0,
            self._cast(ffi, dec._peer, "int *"),
        )
        self.ns[self.current].append(time.perf_counter_ns() - t0)
        if rc:
            raise SystemExit(f"build {self.current}: cpud_decoder_layers returned {rc}")

    def check(self, step: Any) -> None:
        """Every build on the same x and residual; whether their outputs are equal."""
        n = step.T * self.decoder.hidden * torch.finfo(self.decoder.dtype).bits // 8
        cast = self.decoder._ffi.cast
        x, res = int(cast("intptr_t", step.x)), int(cast("intptr_t", step.residual))
        saved = (ctypes.string_at(x, n), ctypes.string_at(res, n))
        outs = []
        for tag in self.builds:
            ctypes.memmove(x, saved[0], n)
            ctypes.memmove(res, saved[1], n)
            self.current = tag
            self.run(step)
            outs.append((ctypes.string_at(x, n), ctypes.string_at(res, n)))
        self.equal.append(all(out == outs[0] for out in outs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--build", action="append", required=True, help="TAG=path of a .so")
    ap.add_argument("--steps", type=int, default=192)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--check", action="store_true", help="bit equality instead of timing")
    ap.add_argument("--streams", type=int, default=1, help="decode this many sequences, <= 32")
    ap.add_argument("--prompt", type=int, default=0, help="steps of a prompt this long instead")
    ap.add_argument(
        "--depth",
        type=int,
        default=0,
        help="decode one stream from this position of a filled cache instead (bench_depth.py)",
    )
    ap.add_argument("--kv-cache-dtype", default="auto", help="with --depth: the cache's format")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    pairs = [b.split("=", 1) for b in args.build]
    builds = {tag: load_build(Path(path), tag) for tag, path in pairs}
    if args.depth:
        run = depth_runner(args.model, args.kv_cache_dtype, args.depth, args.steps + 1)
        fill_cache(run)
    else:
        run = runner(args.model, args.steps + 16)
    if run.decoder is None:
        raise SystemExit(f"{args.model}: the fused decoder does not run this model")
    routed = Builds(run.decoder, builds)
    run.decoder._run = routed.check if args.check else routed.run
    tags = list(builds)
    if args.depth:
        decode_at_depth(run, routed, args.depth, args.steps, args.check)
    else:
        steps(run, routed, args)
    if args.check:
        print(f"bit-equal steps: {sum(routed.equal)} of {len(routed.equal)}")
        return
    first = statistics.median(routed.ns[tags[0]])
    for tag in tags:
        median = statistics.median(routed.ns[tag])
        print(
            f"{tag}: layer call median {median / 1e6:.3f} ms over {len(routed.ns[tag])} steps, "
            f"{first / median:.3f}x {tags[0]}"
        )


def decode_at_depth(run: Any, routed: Builds, depth: int, count: int, check: bool) -> None:
    """`count` decode steps of one stream from position depth, the builds in turn."""
    table = torch.arange(run.kv_caches[0][0].shape[0], dtype=torch.int32)[None, :]
    token = torch.tensor([11])
    probe = None if check else ReadProbe(1024)
    before = probe.gbs() if probe else 0.0
    with torch.inference_mode():
        for i in range(count):
            routed.turn(i)
            run.decoder.forward(token, torch.tensor([depth + i]), step_meta(depth + i, table))
    if probe:
        print(f"read probe: {before:.1f} GB/s before, {probe.gbs():.1f} GB/s after")


def steps(run: Any, routed: Builds, args: argparse.Namespace) -> None:
    """Decode steps of --streams sequences, or --prompt prefills, the builds in turn."""
    per = -(-(args.steps + 16) // 16)
    tables = [list(range(s * per, (s + 1) * per)) for s in range(args.streams)]
    run.execute(
        StepPlan(0, [SeqWork(s, [11] * 8, 0, tables[s], True) for s in range(args.streams)])
    )
    prompt = [(37 * i + 11) % 500 + 3 for i in range(args.prompt)]
    prompt_table = list(range(-(-args.prompt // 16)))
    for times in routed.ns.values():
        times.clear()
    probe = None if args.check else ReadProbe(1024)
    before = probe.gbs() if probe else 0.0
    for i in range(args.steps):
        routed.turn(i)
        if prompt:
            seqs = [SeqWork(args.streams + i, prompt, 0, prompt_table, True)]
        else:
            seqs = [
                SeqWork(s, [20 + 7 * s + i], 8 + i, tables[s], True) for s in range(args.streams)
            ]
        run.execute(StepPlan(1 + i, seqs))
    if probe:
        print(f"read probe: {before:.1f} GB/s before, {probe.gbs():.1f} GB/s after")


if __name__ == "__main__":
    main()
