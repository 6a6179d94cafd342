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
    python perf/bench_moe.py --preset gpt-oss-20b-4l  # gpt-oss-20b's shape, 4 of 24 layers,
                                                      # MXFP4 experts (perf/bench_moe_gptoss.py)

Also reported: decode 1's step split into phases (step inputs, embedding, the layers in one
native call, final norm, LM head, sampling, the rest) with the layers' and the LM head's read
rate against the probe, and the process's resident memory after loading against the file's
size (the runner is this process: its RSS is the rank's).
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
GPT_OSS = "gpt-oss-20b-4l"
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


class PhaseTimer:
    """Wall time of a decode step's phases, summed while `timing` is set: wraps the runner's
    step inputs, the fused decoder's embedding, native layer call and final norm, the LM head
    and sampling (the rest of a step: plan bookkeeping and tensor glue)."""

    PHASES = ("inputs", "embed", "layers", "final_norm", "lm_head", "sample")

    def __init__(self, run: ModelRunner) -> None:
        import cpud.ranks.model_runner as model_runner

        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self.timing = False
        decoder = run.decoder
        self._wrap(model_runner, "build_step_inputs", "inputs")
        self._wrap(model_runner, "sample_or_verify", "sample")
        self._wrap(run.model, "compute_logits", "lm_head")
        if decoder is not None:
            self._wrap(decoder, "_run", "layers")
            for name in ("embed", "final_norm"):  # fields of a frozen table
                object.__setattr__(
                    decoder.table, name, self._timed(getattr(decoder.table, name), name)
                )

    def _timed(self, fn: Any, phase: str) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.timing:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - t0

        return timed

    def _wrap(self, owner: Any, name: str, phase: str) -> None:
        setattr(owner, name, self._timed(getattr(owner, name), phase))


def lm_head_bytes(model: torch.nn.Module) -> int:
    """Bytes of the LM head's packed weight on this rank (bf16 packed or kept in blocks)."""
    head = model.lm_head
    if head.quant is not None:
        return sum(w.qs.nbytes + w.sc.nbytes for _, w in head.quant)
    return head.packed.data.nbytes


def resident() -> dict[str, int]:
    """This process's resident bytes now and at its peak (VmRSS, VmHWM)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM")}


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
    run: ModelRunner,
    streams: int,
    steps: int,
    counter: ExpertCounter | None = None,
    phases: PhaseTimer | None = None,
) -> float:
    """Seconds of `steps` decode steps of `streams` sequences after an 8-token prefill; the
    counter, if given, counts the decode steps' experts."""
    per = -(-(steps + 8) // BLOCK)
    tables = [list(range(s * per, (s + 1) * per)) for s in range(streams)]
    first = [SeqWork(s, [11 + s] * 8, 0, tables[s], True) for s in range(streams)]
    run.execute(StepPlan(0, first))
    if counter is not None:
        counter.routed, counter.counting = 0, True
    if phases is not None:
        phases.seconds, phases.timing = dict.fromkeys(phases.PHASES, 0.0), True
    try:
        t0 = time.perf_counter()
        for i in range(steps):
            seqs = [SeqWork(s, [20 + 7 * s + i], 8 + i, tables[s], True) for s in range(streams)]
            run.execute(StepPlan(1 + i, seqs))
        return time.perf_counter() - t0
    finally:
        if phases is not None:
            phases.timing = False


def decode(
    run: ModelRunner, counter: ExpertCounter, streams: int, steps: int, phases: PhaseTimer
) -> dict[str, Any]:
    # timed: the fused decoder where it runs (decode 1: split into phases)
    seconds = decode_steps(run, streams, steps, phases=phases if streams == 1 else None)
    fused, run.decoder = run.decoder, None  # untimed: the same steps op by op, counted
    try:
        decode_steps(run, streams, steps, counter)
    finally:
        run.decoder, counter.counting = fused, False
    step_bytes = other_weight_bytes(run.model) + counter.routed / steps * counter.expert_bytes()
    out = {
        "tok_s": streams * steps / seconds,
        "experts_per_layer_step": counter.routed / steps / len(counter.blocks),
        "step_bytes": step_bytes,
        "weight_read_gbs": step_bytes * steps / seconds / 1e9,
    }
    if streams == 1:
        split = {k: v / steps * 1e3 for k, v in phases.seconds.items()}
        split["other"] = seconds / steps * 1e3 - sum(split.values())
        out["phase_ms"] = split
        head = lm_head_bytes(run.model)
        if split["lm_head"] > 0:
            out["lm_head_read_gbs"] = head / split["lm_head"] / 1e6
        if split["layers"] > 0:
            out["layers_read_gbs"] = (step_bytes - head) / split["layers"] / 1e6
    return out


def read_probe_gbs(mib: int = 1024) -> float:
    kern = native.kernels()
    buf = huge_empty((mib << 20,), torch.uint8)
    buf.random_(0, 256)
    kern.read_probe(buf)
    t0 = time.perf_counter()
    kern.read_probe(buf)
    return buf.numel() / (time.perf_counter() - t0) / 1e9


def model_path(args: argparse.Namespace) -> Path:
    """--model, else the preset's fixture (made once in --workdir), as a GGUF file of the
    --quant mix where asked; gpt-oss-20b-4l: its MXFP4 GGUF file."""
    if args.model is not None:
        return args.model if not args.quant else make_gguf(args.model, args.quant, args.workdir)
    if args.preset == GPT_OSS and not args.tiny:
        from bench_moe_gptoss import make_gpt_oss_gguf

        return make_gpt_oss_gguf(args.workdir)
    from cpud.fixtures import make_model

    preset = "tiny" if args.tiny else PRESET
    path = args.workdir / f"qwen3_moe-{preset}"
    if not (path / "config.json").exists():
        make_model("qwen3_moe", preset, path, dtype="bfloat16")
    return make_gguf(path, args.quant, args.workdir) if args.quant else path


def _median_fields(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each field's median over the rounds (per key for a dict field)."""
    out: dict[str, Any] = {}
    for field, first in rounds[0].items():
        if isinstance(first, dict):
            out[field] = {k: statistics.median(r[field][k] for r in rounds) for k in first}
        else:
            out[field] = statistics.median(r[field] for r in rounds)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/moe-bench"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--quant", choices=list(QUANT), help="run the fixture as a GGUF file")
    ap.add_argument(
        "--preset",
        choices=(PRESET, GPT_OSS),
        default=PRESET,
        help=f"{GPT_OSS}: the gpt-oss fixture as a GGUF file with MXFP4 experts",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = model_path(args)
    baseline = resident()["VmRSS"]
    run = runner(path, args.steps)
    memory = resident()
    counter = ExpertCounter(run.model)
    phases = PhaseTimer(run)
    results: dict[str, list] = {"prefill_512": [], "decode_1": [], "decode_32": []}
    for _ in range(args.rounds):
        results["prefill_512"].append(prefill(run))
        results["decode_1"].append(decode(run, counter, 1, args.steps, phases))
        results["decode_32"].append(decode(run, counter, STREAMS, args.steps, phases))
    median = {
        "prefill_512": statistics.median(results["prefill_512"]),
        **{k: _median_fields(results[k]) for k in ("decode_1", "decode_32")},
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
        "rss_bytes": memory["VmRSS"],
        "rss_before_load_bytes": baseline,
        "peak_rss_bytes": memory["VmHWM"],
        "per_round": results,
    }
    if path.is_file():
        summary["file_bytes"] = path.stat().st_size
        summary["rss_of_file"] = memory["VmRSS"] / path.stat().st_size
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
