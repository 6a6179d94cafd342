"""Mixture-of-experts decode and prefill on the qwen3-30b-a3b-6l fixture (Qwen3-30B-A3B's
shape with 6 of its 48 layers), bf16, native kernels, one rank, straight on ModelRunner steps;
with --quant, the fixture as a GGUF file whose experts (and other matrices) stay in their
blocks: Q4_K_M (Q4_K gate/up, Q6_K down, Q4_K elsewhere, as llama.cpp's mix) or Q8_0.

Reports prefill of 512 tokens and decode of 1 and 32 streams (tok/s, the LM head included),
and for each decode the bytes a step reads (perf/moe_step_bytes.py: every weight as the
kernels hold it, only the experts the step routed to, counted per layer from the router's
choices, KV rows, norms, the logits) against the read probe (1 GiB, best of 3 passes) measured
just before that decode.

    python perf/bench_moe.py [--workdir /tmp/moe-bench] [--rounds 2] [--steps 16]
    python perf/bench_moe.py --model DIR          # any MoE model directory
    python perf/bench_moe.py --tiny               # the tiny test fixture: checks the script
    python perf/bench_moe.py --quant Q4_K_M       # the preset as a Q4_K_M GGUF file
    python perf/bench_moe.py --tiny --quant Q8_0 --rounds 1 --steps 2
    python perf/bench_moe.py --preset gpt-oss-20b-4l  # gpt-oss-20b's shape, 4 of 24 layers,
                                                      # MXFP4 experts (perf/bench_moe_gptoss.py)

Also reported: decode 1's step split into phases (step inputs, embedding, the layers in one
native call, final norm, LM head, sampling, the rest) with each phase's bytes and read rate,
the LM head alone on one row (its read rate beside the probe's), the threads' involuntary
context switches per timed step (a round that shared its cores), and the process's resident
memory after loading against the file's size (the runner is this process: its RSS is the
rank's).
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
from moe_step_bytes import PHASES, step_bytes

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
    (transformers' routing in torch), summed over the steps while `counting` is set; wraps each
    block's forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers = list(model.model.layers)
        self.blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        self.routed = dict.fromkeys(range(len(self.blocks)), 0)
        self.counting = False
        for index, block in enumerate(self.blocks):
            forward = block.forward

            def counted(x, index=index, block=block, forward=forward):
                if self.counting:
                    _, ids = route(block.gate(x), block.top_k, block.renormalize, x.dtype)
                    self.routed[index] += int(torch.unique(ids).numel())
                return forward(x)

            block.forward = counted

    def start(self) -> None:
        self.routed, self.counting = dict.fromkeys(self.routed, 0), True

    def per_layer(self, steps: int) -> list[float]:
        """Mean distinct experts a step routed to, per decoder layer (0 for a dense one)."""
        of_block = {id(block): self.routed[i] / steps for i, block in enumerate(self.blocks)}
        return [of_block.get(id(layer.mlp), 0.0) for layer in self.layers]


class WallTimer:
    """Wall time of wrapped calls summed per phase while `timing` is set; `calls` counts them."""

    def __init__(self, phases: tuple[str, ...]) -> None:
        self.seconds = dict.fromkeys(phases, 0.0)
        self.calls = dict.fromkeys(phases, 0)
        self.timing = False

    def _timed(self, fn: Any, phase: str) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.timing:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - t0
                self.calls[phase] += 1

        return timed

    def _wrap(self, owner: Any, name: str, phase: str) -> None:
        setattr(owner, name, self._timed(getattr(owner, name), phase))


class PhaseTimer(WallTimer):
    """Wall time of a decode step's phases, summed while `timing` is set: wraps the runner's
    step inputs, the fused decoder's embedding, native layer call and final norm, the LM head
    and sampling (the rest of a step: plan bookkeeping and tensor glue)."""

    PHASES = ("inputs", "embed", "layers", "final_norm", "lm_head", "sample")

    def __init__(self, run: ModelRunner) -> None:
        import cpud.ranks.model_runner as model_runner

        super().__init__(self.PHASES)
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


def resident() -> dict[str, int]:
    """This process's resident bytes now and at its peak (VmRSS, VmHWM)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM")}


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
        counter.start()
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


def preemptions() -> int:
    """Involuntary context switches of this process's threads so far: a timed round with
    several per step shared its cores (each one also stalls the team's barriers)."""
    total = 0
    for task in Path("/proc/self/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("nonvoluntary_ctxt_switches"):
                total += int(line.split()[1])
    return total


def kv_token_bytes(run: ModelRunner) -> int:
    """One token's K and V rows in one layer's cache on this rank."""
    key, value = run.kv_caches[0]
    return (key.nbytes + value.nbytes) // (key.shape[0] * BLOCK)


def decode(
    run: ModelRunner,
    counter: ExpertCounter,
    streams: int,
    steps: int,
    phases: PhaseTimer,
    probe: ReadProbe,
) -> dict[str, Any]:
    """tok/s of `steps` decode steps of `streams` sequences, the bytes a step reads (by phase
    for decode 1, with the phases' times and read rates) against the read probe measured just
    before."""
    probe_gbs = probe.gbs()
    # timed: the fused decoder where it runs (decode 1: split into phases)
    switches = preemptions()
    seconds = decode_steps(run, streams, steps, phases=phases if streams == 1 else None)
    switches = preemptions() - switches
    fused, run.decoder = run.decoder, None  # untimed: the same steps op by op, counted
    try:
        decode_steps(run, streams, steps, counter)
    finally:
        run.decoder, counter.counting = fused, False
    contexts = [8 + (steps + 1) / 2] * streams  # each step attends to 9 .. 8 + steps tokens
    routed = counter.per_layer(steps)
    by_phase = step_bytes(run.model, routed, contexts, kv_token_bytes(run))
    total = sum(by_phase.values())
    out = {
        "tok_s": streams * steps / seconds,
        "experts_per_layer_step": statistics.mean(r for r in routed if r) if any(routed) else 0,
        "step_bytes": total,
        "read_gbs": total * steps / seconds / 1e9,
        "read_probe_gbs": probe_gbs,
        "preempted_per_step": switches / (steps + 1),  # the 8-token first step too
    }
    out["of_probe"] = out["read_gbs"] / probe_gbs
    if streams == 1:
        split = {k: v / steps * 1e3 for k, v in phases.seconds.items()}
        split["other"] = seconds / steps * 1e3 - sum(split.values())
        out["phase_ms"] = split
        out["phase_bytes"] = by_phase
        out["phase_read_gbs"] = {
            k: by_phase[k] / split[k] / 1e6 for k in PHASES if by_phase[k] and split[k] > 0
        }
        out["lm_head_alone_gbs"] = by_phase["lm_head"] / lm_head_seconds(run) / 1e9
    return out


def lm_head_seconds(run: ModelRunner, passes: int = 5) -> float:
    """The LM head on one row alone, best of `passes` (beside the probe's figure)."""
    hidden = torch.randn(1, run.model.cfg.hidden_size).to(run.config.dtype)
    run.model.compute_logits(hidden)
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        run.model.compute_logits(hidden)
        best = min(best, time.perf_counter() - t0)
    return best


class ReadProbe:
    """The native read probe over a buffer of `mib` MiB (DRAM-sized: 1 GiB): GB/s, the best
    of `passes` passes after a warm one."""

    def __init__(self, mib: int, passes: int = 3) -> None:
        self.buf = huge_empty((mib << 20,), torch.uint8)
        self.buf.random_(0, 256)
        self.passes = passes
        self.kern = native.kernels()

    def gbs(self) -> float:
        self.kern.read_probe(self.buf)
        best = float("inf")
        for _ in range(self.passes):
            t0 = time.perf_counter()
            self.kern.read_probe(self.buf)
            best = min(best, time.perf_counter() - t0)
        return self.buf.numel() / best / 1e9


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
    probe = ReadProbe(64 if args.tiny else 1024)
    results: dict[str, list] = {"prefill_512": [], "decode_1": [], "decode_32": []}
    for _ in range(args.rounds):
        results["prefill_512"].append(prefill(run))
        results["decode_1"].append(decode(run, counter, 1, args.steps, phases, probe))
        results["decode_32"].append(decode(run, counter, STREAMS, args.steps, phases, probe))
    median = {
        "prefill_512": statistics.median(results["prefill_512"]),
        **{k: _median_fields(results[k]) for k in ("decode_1", "decode_32")},
    }
    summary = {
        "model": str(path),
        "quant": args.quant,
        "fused_decoder": run.decoder is not None,
        "threads": args.threads,
        "isa": native.isa(),
        "rounds": args.rounds,
        "median": median,
        "read_probe_gbs": median["decode_1"]["read_probe_gbs"],
        "decode_1_of_probe": median["decode_1"]["of_probe"],
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
