"""Mixture-of-experts decode and prefill on the qwen3-30b-a3b-6l fixture (Qwen3-30B-A3B's
shape with 6 of its 48 layers), bf16, native kernels, one rank, straight on ModelRunner steps;
with --quant, the fixture as a GGUF file whose experts (and other matrices) stay in their
blocks: Q4_K_M (Q4_K gate/up, Q6_K down, Q4_K elsewhere, as llama.cpp's mix) or Q8_0.

Reports prefill of 512 tokens and decode of 1 and 32 streams (tok/s, the LM head included),
and for each decode the bytes a step reads: the weights outside the experts plus the experts
the step routed to (counted per layer from the router's choices), against the read probe's
bandwidth on this machine.

    python perf/bench_moe.py [--workdir /tmp/moe-bench] [--rounds 2] [--steps 16]
    python perf/bench_moe.py --model DIR          # any MoE model directory
    python perf/bench_moe.py --tiny               # the tiny test fixture: checks the script
    python perf/bench_moe.py --quant Q4_K_M       # the preset as a Q4_K_M GGUF file
    python perf/bench_moe.py --tiny --quant Q8_0 --rounds 1 --steps 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from cpud import native
from cpud.model.load import load_model_config
from cpud.native.hugepages import huge_empty
from cpud.protocol.step import SeqWork, StepPlan
from cpud.ranks.layers.moe import SparseMoeBlock, route
from cpud.ranks.model_runner import ModelRunner, RunnerConfig
from cpud.ranks.parallel import SingleRank

BLOCK = 16
PREFILL = 512
STREAMS = 32
PRESET = "qwen3-30b-a3b-6l"
# --quant: (expert stacks by projection, the other matrices)
QUANT = {
    "Q4_K_M": ({"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}, "Q4_K"),
    "Q8_0": ({"gate": "Q8_0", "up": "Q8_0", "down": "Q8_0"}, "Q8_0"),
}


class ExpertCounter:
    """Counts the distinct experts each expert layer routes to, from the router's choices
    (transformers' routing in torch), while `counting` is set; wraps each block's forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        self.routed = 0
        self.counting = False
        for block in self.blocks:
            forward = block.forward

            def counted(x, block=block, forward=forward):
                if self.counting:
                    _, ids = route(block.gate(x), block.top_k, block.renormalize, x.dtype)
                    self.routed += int(torch.unique(ids).numel())
                return forward(x)

            block.forward = counted

    def expert_bytes(self) -> int:
        """Bytes of one expert's packed gate/up and down on this rank (bf16 or in blocks)."""
        experts = self.blocks[0].experts
        return sum(s.weight_bytes for s in experts.stacks()) // experts.num_experts


def other_weight_bytes(model: torch.nn.Module) -> int:
    """Packed bytes of every matmul weight outside the experts (read every step): bf16 packed
    or kept in blocks."""
    from cpud.ranks.gguf_experts import expert_bytes
    from cpud.ranks.quant_linear import quant_bytes

    packed = sum(
        m.packed.data.numel() * 2
        for m in model.modules()
        if getattr(m, "packed", None) is not None and hasattr(m.packed, "data")
    )
    return packed + quant_bytes(model) - expert_bytes(model)


def make_gguf(source: Path, quant: str, workdir: Path) -> Path:
    """The fixture directory as a GGUF file of the --quant mix (tests/test_moe_gguf.py's
    writer, K-quants by tests/gguf_kquants.py)."""
    out = workdir / f"{source.name}-{quant}.gguf"
    if out.exists():
        return out
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from gguf import GGMLQuantizationType as T
    from test_moe_gguf import write_moe_gguf

    experts, dense = QUANT[quant]
    partial = out.with_suffix(".partial")
    write_moe_gguf(
        source, partial, {p: T[t] for p, t in experts.items()}, T[dense], keep_values=False
    )
    partial.rename(out)
    return out


def runner(path: Path, steps: int) -> ModelRunner:
    blocks = STREAMS * (-(-(steps + 8) // BLOCK)) + PREFILL // BLOCK + 8
    config = RunnerConfig(
        path, torch.bfloat16, 1024, BLOCK, blocks, kernels="native", kv_pretouch=False
    )
    return ModelRunner(config, load_model_config(path), SingleRank())


def prefill(run: ModelRunner) -> float:
    plan = StepPlan(0, [SeqWork(0, list(range(7, 7 + PREFILL)), 0, list(range(32)), True)])
    t0 = time.perf_counter()
    run.execute(plan)
    return PREFILL / (time.perf_counter() - t0)


def decode_steps(
    run: ModelRunner, streams: int, steps: int, counter: ExpertCounter | None = None
) -> float:
    """Seconds of `steps` decode steps of `streams` sequences after an 8-token prefill; the
    counter, if given, counts the decode steps' experts."""
    per = -(-(steps + 8) // BLOCK)
    tables = [list(range(s * per, (s + 1) * per)) for s in range(streams)]
    first = [SeqWork(s, [11 + s] * 8, 0, tables[s], True) for s in range(streams)]
    run.execute(StepPlan(0, first))
    if counter is not None:
        counter.routed, counter.counting = 0, True
    t0 = time.perf_counter()
    for i in range(steps):
        seqs = [SeqWork(s, [20 + 7 * s + i], 8 + i, tables[s], True) for s in range(streams)]
        run.execute(StepPlan(1 + i, seqs))
    return time.perf_counter() - t0


def decode(run: ModelRunner, counter: ExpertCounter, streams: int, steps: int) -> dict[str, Any]:
    seconds = decode_steps(run, streams, steps)  # timed: the fused decoder where it runs
    fused, run.decoder = run.decoder, None  # untimed: the same steps op by op, counted
    try:
        decode_steps(run, streams, steps, counter)
    finally:
        run.decoder, counter.counting = fused, False
    step_bytes = other_weight_bytes(run.model) + counter.routed / steps * counter.expert_bytes()
    return {
        "tok_s": streams * steps / seconds,
        "experts_per_layer_step": counter.routed / steps / len(counter.blocks),
        "step_bytes": step_bytes,
        "weight_read_gbs": step_bytes * steps / seconds / 1e9,
    }


def read_probe_gbs(mib: int = 1024) -> float:
    kern = native.kernels()
    buf = huge_empty((mib << 20,), torch.uint8)
    buf.random_(0, 256)
    kern.read_probe(buf)
    t0 = time.perf_counter()
    kern.read_probe(buf)
    return buf.numel() / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/moe-bench"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--quant", choices=list(QUANT), help="run the fixture as a GGUF file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model
    if path is None:
        from cpud.fixtures import make_model

        arch, preset = ("qwen3_moe", "tiny") if args.tiny else ("qwen3_moe", PRESET)
        path = args.workdir / f"{arch}-{preset}"
        if not (path / "config.json").exists():
            make_model(arch, preset, path, dtype="bfloat16")
    if args.quant:
        path = make_gguf(path, args.quant, args.workdir)
    run = runner(path, args.steps)
    counter = ExpertCounter(run.model)
    results: dict[str, list] = {"prefill_512": [], "decode_1": [], "decode_32": []}
    for _ in range(args.rounds):
        results["prefill_512"].append(prefill(run))
        results["decode_1"].append(decode(run, counter, 1, args.steps))
        results["decode_32"].append(decode(run, counter, STREAMS, args.steps))
    median = {
        "prefill_512": statistics.median(results["prefill_512"]),
        **{
            k: {f: statistics.median(r[f] for r in results[k]) for f in results[k][0]}
            for k in ("decode_1", "decode_32")
        },
    }
    probe = read_probe_gbs(64 if args.tiny else 1024)
    summary = {
        "model": str(path),
        "quant": args.quant,
        "fused_decoder": run.decoder is not None,
        "threads": args.threads,
        "isa": native.isa(),
        "rounds": args.rounds,
        "median": median,
        "read_probe_gbs": probe,
        "decode_1_of_probe": median["decode_1"]["weight_read_gbs"] / probe,
        "per_round": results,
    }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
