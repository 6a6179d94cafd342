"""The quantized linears inside the fused decoder against the read probe, one weight format at a
time: decode 1 on qwen3-0.6b-shaped files whose every matrix is in that one format.

Files: the qwen3-0.6b bf16 GGUF (--preset llama-3.2-1b: that fixture's, for hosts whose last-level
cache holds much of the smaller one) (perf/bench_quant_peer.py's) quantized by llama-quantize
--pure, so each holds a single format: Q8_0, Q4_0, Q4_1, Q4_K (from Q4_K_S), Q5_K (Q5_K_S),
Q6_K; --gguf adds files of your own (e.g. perf/bench_moe_gptoss.py's MXFP4 file). Each runs on
a ModelRunner in this process (bench_moe.runner) with the step split into phases
(bench_moe.PhaseTimer); the layers' read rate is the bytes the layers phase reads
(perf/moe_step_bytes.py: every linear's packed weight, norms, the KV rows) over its time, the LM
head's likewise. Every round runs every format once, each bracketed by the read probe (1 GiB,
best of 3, in this process, between the runs); a figure whose two probe readings spread past
read_periods.MIXED_SPREAD is left out, the rest are put into the host's slow or fast memory
period by their probe (perf/read_periods.py) and reported as the median share of the probe per
format and period.

    python perf/bench_decoder_formats.py [--rounds 4] [--steps 48] [--formats Q8_0 Q4_K]
        [--preset qwen3-0.6b]
        [--gguf FILE ...] [--out perf/results/decoder_formats_<cpu>.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from bench_moe import ExpertCounter, PhaseTimer, ReadProbe, decode, runner
from bench_quant_kernels import run_record, save_record
from peers import llamacpp
from read_periods import mixed, period_names

from cpud.fixtures.presets import REALISTIC

# format -> llama-quantize type that, with --pure, writes every matrix in it
PURE = {
    "Q8_0": "Q8_0",
    "Q4_0": "Q4_0",
    "Q4_1": "Q4_1",
    "Q4_K": "Q4_K_S",
    "Q5_K": "Q5_K_S",
    "Q6_K": "Q6_K",
}


def format_files(formats: list[str], preset: str) -> dict[str, Path]:
    """The bf16 GGUF of the preset's fixture quantized --pure to each format (made once, kept
    in the peers cache beside bench_quant_peer.py's files)."""
    model_dir = llamacpp.preset_model(preset)
    bf16 = llamacpp.convert(model_dir, llamacpp.gguf_path(model_dir, "bf16"))
    cache = llamacpp.default_cache_dir() / "gguf"
    return {
        name: llamacpp.quantize(
            bf16, cache / f"{bf16.stem}.pure-{name}.gguf", PURE[name], pure=True
        )
        for name in formats
    }


def by_period(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Median layers / probe and LM head / probe per period and format, from the samples whose
    probe readings agree; the periods split at the middle of the probe's range where it spreads
    past MIXED_SPREAD (else one period, "one")."""
    clean = [s for s in samples if not mixed(s["probe_gbs"])]
    if not clean:
        return {}
    probes = [statistics.mean(s["probe_gbs"]) for s in clean]
    grouped: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for s, p, period in zip(clean, probes, period_names(probes), strict=True):
        grouped.setdefault(period, {}).setdefault(s["format"], []).append({**s, "probe": p})
    return {
        period: {
            name: {
                "samples": len(rows),
                "probe_gbs": statistics.median(r["probe"] for r in rows),
                "layers_gbs": statistics.median(r["layers_gbs"] for r in rows),
                "layers_of_probe": statistics.median(r["layers_gbs"] / r["probe"] for r in rows),
                "lm_head_of_probe": statistics.median(r["lm_head_gbs"] / r["probe"] for r in rows),
                "tok_s": statistics.median(r["tok_s"] for r in rows),
            }
            for name, rows in formats.items()
        }
        for period, formats in grouped.items()
    }


def table(summary: dict[str, Any]) -> str:
    lines = [
        "| period | format | layers GB/s | probe GB/s | layers / probe | LM head / probe | tok/s "
        "| samples |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for period, formats in summary.items():
        for name, r in formats.items():
            lines.append(
                f"| {period} | {name} | {r['layers_gbs']:.1f} | {r['probe_gbs']:.1f} "
                f"| {r['layers_of_probe']:.0%} | {r['lm_head_of_probe']:.0%} | {r['tok_s']:.1f} "
                f"| {r['samples']} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--formats", nargs="*", default=list(PURE), choices=list(PURE))
    ap.add_argument("--preset", default="qwen3-0.6b", choices=list(REALISTIC))
    ap.add_argument("--gguf", nargs="*", type=Path, default=[], help="more files, by name")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.rounds < 1 or args.steps < 2:
        sys.exit("--rounds must be >= 1 and --steps >= 2")
    missing = [str(p) for p in args.gguf if not p.is_file()]
    if missing:
        sys.exit(f"no such file: {', '.join(missing)}")
    files = {**format_files(args.formats, args.preset), **{p.stem: p for p in args.gguf}}
    runners = {name: runner(path, args.steps) for name, path in files.items()}
    counters = {name: ExpertCounter(run.model) for name, run in runners.items()}
    phases = {name: PhaseTimer(run) for name, run in runners.items()}
    probe = ReadProbe(1024)
    samples = []
    for r in range(args.rounds):
        for name, run in runners.items():
            out = decode(run, counters[name], 1, args.steps, phases[name], probe)
            readings = [out["read_probe_gbs"], probe.gbs()]
            sample = {
                "round": r,
                "format": name,
                "probe_gbs": readings,
                "layers_gbs": out["phase_read_gbs"]["layers"],
                "lm_head_gbs": out["phase_read_gbs"]["lm_head"],
                "tok_s": out["tok_s"],
                "preempted_per_step": out["preempted_per_step"],
            }
            samples.append(sample)
            print(json.dumps(sample), flush=True)
    summary = by_period(samples)
    print(table(summary))
    result = {
        **run_record("bench_decoder_formats.py"),
        "threads": torch.get_num_threads(),
        "files": {name: str(path) for name, path in files.items()},
        "summary": summary,
        "samples": samples,
    }
    save_record(result, args.out, "decoder_formats")


if __name__ == "__main__":
    main()
