"""Where a decode step's time goes, end to end through the engine (cpud.LLM, one rank in this
process): the engine's scheduler, step planning, the plan's bookkeeping after the step and the
outputs; the rank's step inputs, embedding, fused layer call, final norm, LM head and sampling;
"engine other" and "rank other" are the rest of each side (glue, the step loop). Mean wall time per
step over `--steps` decode steps of `--streams` sequences, each count of streams in its own
generate call after a warm one.

    python perf/bench_step_split.py FILE.gguf [--streams 1 64] [--steps 128]
        [--out perf/results/step_split_<cpu>.json]
    python perf/bench_step_split.py --preset qwen3-0.6b       # the bf16 fixture directory
    python perf/bench_step_split.py --preset llama-3.2-1b --gguf-type Q4_K_M  # llama-quantize'd
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from bench_moe import PhaseTimer, WallTimer
from bench_quant_kernels import run_record, save_record

from cpud import LLM, SamplingParams

ENGINE_PHASES = ("schedule", "plan", "execute", "after_step", "outputs")


class EngineTimer(WallTimer):
    """Sums of wall time per engine phase and of whole steps, while `timing` is set."""

    def __init__(self, engine: Any) -> None:
        super().__init__((*ENGINE_PHASES, "step"))
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.planner, "plan", "plan")
        self._wrap(engine, "_execute", "execute")
        self._wrap(engine.planner, "sent", "after_step")
        self._wrap(engine.outputs, "output", "outputs")
        self._wrap(engine, "step", "step")


def split(llm: LLM, streams: int, steps: int) -> dict[str, Any]:
    """Mean microseconds per decode step of each phase, and the step rate."""
    runner = llm.engine.executor.runner
    rank = PhaseTimer(runner)
    engine = EngineTimer(llm.engine)
    prompts = [[7 + s, *range(20, 51)] for s in range(streams)]
    warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate(prompts, warm)
    # the prefill step is timed too; with `steps` decode steps after it its share is small
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    rank.timing = engine.timing = True
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    rank.timing = engine.timing = False
    n = engine.calls["step"]
    us = {k: 1e6 * v / n for k, v in engine.seconds.items()}
    ranks = {k: 1e6 * v / n for k, v in rank.seconds.items()}
    engine_side = {k: us[k] for k in ENGINE_PHASES if k != "execute"}
    engine_side["engine other"] = us["step"] - sum(engine_side.values()) - us["execute"]
    rank_side = dict(ranks)
    rank_side["rank other"] = us["execute"] - sum(ranks.values())
    return {
        "streams": streams,
        "steps": n,
        "step_us": us["step"],
        "loop_us": 1e6 * wall / n - us["step"],
        "tok_s": streams * n / wall,
        "engine_us": engine_side,
        "rank_us": rank_side,
    }


def table(rows: list[dict[str, Any]]) -> str:
    names = [*rows[0]["engine_us"], *rows[0]["rank_us"]]
    head = "| phase | " + " | ".join(f"{r['streams']} stream(s), us/step" for r in rows) + " |"
    lines = [head, "|---|" + "---|" * len(rows)]
    for name in names:
        cells = []
        for r in rows:
            v = {**r["engine_us"], **r["rank_us"]}[name]
            cells.append(f"{v:.0f} ({v / r['step_us']:.1%})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("| whole step | " + " | ".join(f"{r['step_us']:.0f}" for r in rows) + " |")
    lines.append("| tok/s | " + " | ".join(f"{r['tok_s']:.1f}" for r in rows) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="a GGUF file or model directory")
    ap.add_argument("--preset", help="a generated fixture instead (qwen3-0.6b, llama-3.2-1b)")
    ap.add_argument(
        "--gguf-type", help="with --preset: its bf16 GGUF quantized by llama-quantize (Q8_0, ...)"
    )
    ap.add_argument("--streams", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if (args.model is None) == (args.preset is None):
        sys.exit("give a model path or --preset: one of the two")
    if args.gguf_type and not args.preset:
        sys.exit("--gguf-type quantizes a --preset's file; a GGUF path is used as it is")
    if args.steps < 8 or min(args.streams) < 1:
        sys.exit("--steps must be >= 8 and every --streams >= 1")
    if args.preset:
        from peers import llamacpp

        try:
            path = llamacpp.preset_model(args.preset)
        except ValueError as exc:
            sys.exit(str(exc))
        if args.gguf_type:
            from bench_quant_peer import files

            cache = llamacpp.default_cache_dir()
            path = files([args.gguf_type], cache, args.preset)[args.gguf_type]
    else:
        path = Path(args.model)
        if not path.exists():
            sys.exit(f"no such model: {path}")
    llm = LLM(
        path,
        dtype="bfloat16",
        max_num_seqs=max(args.streams),
        enable_prefix_caching=False,
        max_model_len=args.steps + 64,
    )
    if not hasattr(llm.engine.executor, "runner"):
        sys.exit("the rank must run in this process (tp 1)")
    rows = [split(llm, streams, args.steps) for streams in args.streams]
    llm.shutdown()
    print(table(rows))
    result = {
        **run_record("bench_step_split.py"),
        "model": str(path),
        "rows": rows,
    }
    save_record(result, args.out, "step_split")


if __name__ == "__main__":
    main()
