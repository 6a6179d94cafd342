"""Decode, 1 stream: TP=2 (one rank per core, shared-memory all-reduce) vs TP=1 (one process,
2 threads), interleaved on the same weights.

    python perf/bench_tp.py --rounds 3

Target: TP=2 >= 0.9x TP=1, i.e. tensor parallelism costs almost nothing. Also reports gloo.
Results: perf/results/tp.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_engine import cpud_decode, model_dir  # noqa: E402

from cpud import LLM  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3")
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--model")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gloo", action="store_true", help="also run TP=2 over gloo")
    parser.add_argument("--json", type=Path, default=RESULTS / "tp.json")
    args = parser.parse_args()
    path = model_dir(args.arch, args.preset, args.model)
    # Engines alternate on the same cores: one's KV pre-fault would run (and stall a vCPU) while
    # another is measured, so none pre-faults and all pay the same first touches.
    common = dict(dtype="bfloat16", max_model_len=512, kv_cache_space_gib=1, kv_pretouch=False)
    engines = {
        "tp1": LLM(path, **common),
        "tp2-shm": LLM(path, **common, tp=2, bind="0|1"),
    }
    if args.gloo:
        engines["tp2-gloo"] = LLM(path, **common, tp=2, bind="0|1", collective="gloo")
    try:
        for llm in engines.values():
            cpud_decode(llm, 1, 32, 4)  # warm-up
        rounds = [
            {name: cpud_decode(llm, 1, 32, args.tokens) for name, llm in engines.items()}
            for _ in range(args.rounds)
        ]
    finally:
        for name, llm in engines.items():
            if name != "tp1":
                llm.shutdown()
    summary = {name: statistics.median(r[name] for r in rounds) for name in engines}
    for name in engines:
        if name != "tp1":
            summary[f"{name}_vs_tp1"] = statistics.median(r[name] / r["tp1"] for r in rounds)
    summary["rounds"] = rounds
    summary["loadavg"] = os.getloadavg()[0]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=2))
    print(
        " | ".join(f"{k} {v:.2f}" for k, v in summary.items() if isinstance(v, float)),
        flush=True,
    )


if __name__ == "__main__":
    main()
