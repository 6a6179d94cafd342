"""The weight cache, measured: load time with and without it, and decode speed on weights mapped
from the cache file (page-cache pages) against weights packed into anonymous huge pages.

    python perf/bench_weight_cache.py                 # qwen3-0.6b preset, 3 rounds
    python perf/bench_weight_cache.py --rounds 5 --model DIR

Each round loads the offline engine with `weight_cache="off"` (read + pack the checkpoint) and
with the cache (the first round writes it, later rounds map it). Then one engine of each kind
runs decode-1 and decode-32, interleaved round by round. Medians; ratios are cached / packed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import bench_engine  # noqa: E402

from cpud import LLM  # noqa: E402


def timed_load(model_dir: Path, cache: str) -> tuple[LLM, float]:
    started = time.perf_counter()
    llm = LLM(model_dir, max_model_len=4096, num_kv_blocks=2048, weight_cache=cache)
    return llm, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: the qwen3-0.6b preset)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default="perf/results/weight_cache.json")
    args = parser.parse_args()
    model_dir = bench_engine.model_dir("qwen3", "qwen3-0.6b", args.model)
    cache = tempfile.mkdtemp(prefix="cpud-weight-cache-")
    try:
        figures = run_rounds(model_dir, cache, args.rounds)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    report(model_dir, figures, args.rounds, Path(args.json))


def run_rounds(model_dir: Path, cache: str, rounds: int) -> dict[str, list[float]]:
    figures: dict[str, list[float]] = {}

    def note(name: str, value: float) -> None:
        figures.setdefault(name, []).append(value)

    for round_index in range(rounds):  # load times: packing vs mapping (round 0 writes)
        for label, setting in (("packed", "off"), ("cached", cache)):
            llm, seconds = timed_load(model_dir, setting)
            note(f"load_s/{'write' if label == 'cached' and round_index == 0 else label}", seconds)
            llm.shutdown()
            del llm
    # Decode on both at once, interleaved, so drift on the machine hits both alike.
    engines = {"packed": timed_load(model_dir, "off")[0], "cached": timed_load(model_dir, cache)[0]}
    for llm in engines.values():
        bench_engine.cpud_decode(llm, 1, 32, 8)  # warm-up
    for _ in range(rounds):
        for streams in (1, 32):
            for label, llm in engines.items():
                note(f"decode-{streams}/{label}", bench_engine.cpud_decode(llm, streams, 32, 64))
    for llm in engines.values():
        llm.shutdown()
    return figures


def report(model_dir: Path, figures: dict[str, list[float]], rounds: int, out: Path) -> None:
    medians = {name: statistics.median(values) for name, values in figures.items()}
    for streams in (1, 32):
        ratio = medians[f"decode-{streams}/cached"] / medians[f"decode-{streams}/packed"]
        medians[f"decode-{streams}/ratio"] = ratio
    load = os.getloadavg()[0]
    print(f"{model_dir.name}: medians of {rounds} rounds, load average {load:.2f}")
    for name, value in medians.items():
        print(f"  {name:24s} {value:8.2f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"medians": medians, "runs": figures}, indent=1))


if __name__ == "__main__":
    main()
