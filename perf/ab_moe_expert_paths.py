"""Packed bf16 SiLU experts through the fused decoder's two expert entries, one process, one
model load, alternated step by step: `moe` (a cpud_moe struct: cpud_moe_layer, inside the
decode thread team) against `ffn` (router / experts addresses: cpud_moe_ffn, op by op with its
own parallel regions). Reports each one's median layer-call time, how many steps ran as one
team, the read probe before and after, and the largest difference of their logits.

    python3 perf/ab_moe_expert_paths.py --model /tmp/moe-bench/qwen3_moe-qwen3-30b-a3b-6l \\
        --steps 96 [--streams 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from bench_moe import ReadProbe, runner

from cpud.protocol.step import SeqWork, StepPlan


def plain(experts: Any) -> bool:
    """What cpud_moe_ffn runs: packed bf16 SiLU experts behind the softmax router, no biases."""
    recipe = experts.recipe
    return (
        experts.packed is not None
        and recipe.router == "softmax_topk"
        and recipe.activation == "silu"
        and not recipe.router_bias
        and not recipe.expert_bias
    )


def ffn_table(decoder: Any) -> Any:
    """A copy of the decoder's layer table whose expert layers name router and experts."""
    ffi, layers = decoder._ffi, decoder.table.layers
    if not all(plain(layer.experts) for layer in layers if layer.experts is not None):
        raise SystemExit("cpud_moe_ffn runs packed bf16 SiLU experts with no biases only")
    table = ffi.new("cpud_decoder_layer[]", len(layers))
    ffi.memmove(table, decoder._layers, ffi.sizeof("cpud_decoder_layer") * len(layers))
    for entry, layer in zip(table, layers):
        if layer.experts is None:
            continue
        gate_up, down = layer.experts.packed
        entry.moe = 0
        entry.router = decoder._addr(layer.router.packed.data)
        entry.experts_gate_up = decoder._addr(gate_up)
        entry.experts_down = decoder._addr(down)
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="a bf16 MoE model directory")
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--streams", type=int, default=1)
    args = ap.parse_args()
    run = runner(args.model, args.steps + 16)
    decoder = run.decoder
    if decoder is None or not any(layer.experts is not None for layer in decoder.table.layers):
        raise SystemExit(f"{args.model}: no fused expert layers to compare")
    tables = {"moe": decoder._layers, "ffn": ffn_table(decoder)}
    ns: dict[str, list[int]] = {tag: [] for tag in tables}
    teams = dict.fromkeys(tables, 0)
    run_layers = decoder._run
    current = ["moe"]

    def timed(step: Any) -> None:
        decoder._layers = tables[current[0]]
        before = decoder.team_steps
        t0 = time.perf_counter_ns()
        run_layers(step)
        ns[current[0]].append(time.perf_counter_ns() - t0)
        teams[current[0]] += decoder.team_steps - before

    decoder._run = timed
    per = -(-(args.steps + 16) // 16)
    blocks = [list(range(s * per, (s + 1) * per)) for s in range(args.streams)]
    prefill = [SeqWork(s, [11] * 8, 0, blocks[s], True) for s in range(args.streams)]
    run.execute(StepPlan(0, prefill))
    logits = {}
    for tag in tables:  # the same step on both tables, for the difference of their logits
        current[0] = tag
        seqs = [SeqWork(s, [20 + s], 8, blocks[s], True) for s in range(args.streams)]
        logits[tag] = run.prompt_logits(StepPlan(1, seqs)).float()
    for times in ns.values():
        times.clear()
    teams = dict.fromkeys(tables, 0)
    probe = ReadProbe(1024)
    first = probe.gbs()
    tags = list(tables)
    for i in range(args.steps):
        order = tags if (i // 2) % 2 == 0 else tags[::-1]
        current[0] = order[i % 2]
        seqs = [SeqWork(s, [30 + 7 * s + i], 9 + i, blocks[s], True) for s in range(args.streams)]
        run.execute(StepPlan(2 + i, seqs))
    print(f"read probe: {first:.1f} GB/s before, {probe.gbs():.1f} GB/s after")
    base = statistics.median(ns["ffn"])
    for tag in tags:
        median = statistics.median(ns[tag])
        print(
            f"{tag}: layer call median {median / 1e6:.3f} ms over {len(ns[tag])} steps "
            f"({teams[tag]} as one team), ffn / this {base / median:.3f}x"
        )
    diff = (logits["moe"] - logits["ffn"]).abs().max().item()
    print(
        f"largest logit difference moe - ffn: {diff:.3g}; same argmax: "
        f"{torch.equal(logits['moe'].argmax(-1), logits['ffn'].argmax(-1))}"
    )


if __name__ == "__main__":
    main()
