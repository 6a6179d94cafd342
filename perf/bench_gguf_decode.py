"""One GGUF file, two ways in one process: linears kept quantized (the int8 GEMM on the blocks,
ranks/quant_linear.py) against dequantized at load to bf16 (the packed bf16 GEMM). Both bf16
activations, native kernels, one rank, fused decoder. Rounds alternate A B A B.

Per round and engine: prefill of 512 tokens (tok/s), decode of 1 stream and of 32 streams
(output tok/s over --steps steps, the LM head included), straight on ModelRunner steps.  For
decode 1 also the GB/s at which the layers' linears read their weights inside the fused decoder
(its own timer around each GEMM call), against the AVX-512 read probe on 1 GiB of huge pages
timed in the same round.

    python perf/bench_gguf_decode.py --make Q4_K [--workdir /tmp/gguf-bench] [--rounds 2]
    python perf/bench_gguf_decode.py --gguf FILE
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_quant_kernels import ReadProbe

from cpud.model.load import load_model_config
from cpud.protocol.step import SeqWork, StepPlan
from cpud.ranks.model_runner import ModelRunner, RunnerConfig
from cpud.ranks.parallel import SingleRank

BLOCK = 16
PREFILL = 512
STREAMS = 32


def make_file(qtype: str, workdir: Path) -> Path:
    """The qwen3-0.6b-shaped fixture as a GGUF of qtype (tests/gguf_writer.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from gguf import GGMLQuantizationType
    from gguf_writer import write_gguf

    from cpud.fixtures import make_model

    out = workdir / f"qwen3-0.6b-{qtype}.gguf"
    if not out.exists():
        source = workdir / "qwen3-0.6b-hf"
        if not (source / "config.json").exists():
            make_model("qwen3", "qwen3-0.6b", source, max_shard_bytes=1 << 40, dtype="float32")
        write_gguf(source, out, GGMLQuantizationType[qtype])
    return out


def runner(path: Path, quantized: bool, steps: int) -> ModelRunner:
    blocks = STREAMS * (-(-(steps + 8) // BLOCK)) + PREFILL // BLOCK + 8
    config = RunnerConfig(
        path, torch.bfloat16, 1024, BLOCK, blocks, kernels="native", kv_pretouch=False
    )
    config = type(config)(**{**config.__dict__, "quantization": "auto" if quantized else "none"})
    return ModelRunner(config, load_model_config(path), SingleRank())


def prefill(run: ModelRunner) -> float:
    plan = StepPlan(0, [SeqWork(0, list(range(7, 7 + PREFILL)), 0, list(range(32)), True)])
    t0 = time.perf_counter()
    run.execute(plan)
    return PREFILL / (time.perf_counter() - t0)


def decode(run: ModelRunner, streams: int, steps: int) -> tuple[float, float]:
    """(output tok/s, GB/s the decoder's dense linears read their weights at)."""
    per = -(-(steps + 8) // BLOCK)
    tables = [list(range(s * per, (s + 1) * per)) for s in range(streams)]
    first = [SeqWork(s, [11 + s] * 8, 0, tables[s], True) for s in range(streams)]
    run.execute(StepPlan(0, first))
    linear0 = run.decoder.linear_seconds
    t0 = time.perf_counter()
    for i in range(steps):
        seqs = [SeqWork(s, [20 + i], 8 + i, tables[s], True) for s in range(streams)]
        run.execute(StepPlan(1 + i, seqs))
    tok_s = streams * steps / (time.perf_counter() - t0)
    linear = run.decoder.linear_seconds - linear0
    return tok_s, run.decoder.linear_bytes * steps / linear / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", type=Path)
    src.add_argument("--make", choices=("Q4_K", "Q8_0", "Q4_0"))
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/gguf-bench"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.workdir.mkdir(parents=True, exist_ok=True)
    path = args.gguf or make_file(args.make, args.workdir)
    engines = {"quantized": runner(path, True, args.steps), "bf16": runner(path, False, args.steps)}
    results: dict[str, dict[str, list[float]]] = {
        name: {"prefill_512": [], "decode_1": [], "decode_32": []} for name in engines
    }
    linear_gbs: dict[str, list[float]] = {name: [] for name in engines}
    probe = ReadProbe(1 << 30)
    probe_gbs: list[float] = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        probe()
        probe_gbs.append(probe.bytes / (time.perf_counter() - t0) / 1e9)
        for name, run in engines.items():
            r = results[name]
            r["prefill_512"].append(prefill(run))
            tok_s, gbs = decode(run, 1, args.steps)
            r["decode_1"].append(tok_s)
            linear_gbs[name].append(gbs)
            r["decode_32"].append(decode(run, STREAMS, args.steps)[0])
    summary = {
        "file": str(path),
        "threads": args.threads,
        "rounds": args.rounds,
        "tok_s": {n: {k: statistics.median(v) for k, v in r.items()} for n, r in results.items()},
        "per_round": results,
    }
    q, b = summary["tok_s"]["quantized"], summary["tok_s"]["bf16"]
    summary["ratio"] = {k: q[k] / b[k] for k in q}
    # decode 1: the layers' linears inside the fused decoder against the read probe, per round
    summary["read_probe_gbs"] = probe_gbs
    summary["decode_1_linear_gbs"] = linear_gbs
    summary["decode_1_linear_vs_probe"] = {
        name: statistics.median(g / p for g, p in zip(v, probe_gbs))
        for name, v in linear_gbs.items()
    }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
