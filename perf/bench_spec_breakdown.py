"""Where a speculating decode step's time goes, beside a plain one (TP=1, in-process ranks).

Runs bench_spec.py's rewrite task once per engine (plain, then n-gram) with probes on the
step's parts, and prints per kind of step (plain 1-row decode, a verify of r rows, a
speculating engine's step that proposed nothing):

- step: the engine's whole step (engine.step), wall ms
- engine: the step outside the executor (scheduling, proposals, plan, outputs)
- rank: the executor's forward_seconds, split into
  - inputs: the rank's step inputs (sequence states, block tables, metadata)
  - linear / other: the fused decoder's GEMVs / GEMMs, and the rest of its layers (attention,
    norms, rotary, KV writes); with the per-op path (no fused decoder) all in `other`
  - head: final norm outside the decoder, LM head (compute_logits)
  - sample: sampling or verification (ranks/spec_verify.py)

and the acceptance figures: steps that proposed, proposals accepted, per position, mean
accepted length, output tokens per step. The bound it reports: tokens per step of the n-gram
engine over its mean step time relative to the plain engine's.

    python perf/bench_spec_breakdown.py [--model PATH] [--k 4] [--max-tokens 160]
        [--lookup-min 2] [--lookup-max 5] [--repeats 1]

A diagnosis, not a benchmark: its ratios come from one process at a time on a shared machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_spec import decode_rate  # noqa: E402

from cpud import LLM  # noqa: E402

PARTS = ("step", "engine", "rank", "inputs", "linear", "other", "head", "sample")


@dataclass
class StepProbe:
    """Milliseconds of each part per kind of step, filled by the wrappers of `install`."""

    parts: dict[str, dict[str, list[float]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list))
    )
    tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    current: dict[str, float] = field(default_factory=dict)
    kind: str = ""

    def add(self, name: str, seconds: float) -> None:
        self.current[name] = self.current.get(name, 0.0) + seconds * 1e3


def step_kind(plan, speculating: bool) -> str:
    """'prefill' for any step with a prompt chunk, else the decode rows per sequence."""
    rows = [len(work.token_ids) for work in plan.seqs]
    if any(work.start_pos is not None for work in plan.seqs) or not rows:
        return "prefill"
    drafts = [work.num_draft for work in plan.seqs]
    if any(drafts):
        return f"verify {max(rows)} rows"
    return "no proposal" if speculating else "plain decode"


def _timed(probe: StepProbe, name: str, fn):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            probe.add(name, time.perf_counter() - started)

    return wrapper


def install(llm: LLM, speculating: bool) -> StepProbe:
    """Wraps this engine's step, executor call and rank parts (instance attributes only)."""
    probe = StepProbe()
    engine = llm.engine
    runner = engine.executor.runner
    decoder = runner.decoder
    execute, step = engine._execute, engine.step

    def probed_execute(plan):
        probe.kind = step_kind(plan, speculating)
        linear_before = decoder.linear_seconds if decoder is not None else 0.0
        started = time.perf_counter()
        result = execute(plan)
        probe.add("executor", time.perf_counter() - started)
        if result is not None:
            probe.add("rank", result.forward_seconds)
            probe.tokens[probe.kind] += len(result.tokens)
        if decoder is not None:
            probe.add("linear", decoder.linear_seconds - linear_before)
        return result

    def probed_step():
        probe.current, probe.kind = {}, ""
        started = time.perf_counter()
        outputs = step()
        probe.add("step", time.perf_counter() - started)
        if probe.kind:
            ms = probe.current
            forward = ms.get("forward", 0.0)
            decoder_ms = ms.get("decoder", forward)
            ms["engine"] = ms["step"] - ms.get("executor", 0.0)
            ms["inputs"] = forward - decoder_ms
            ms["other"] = decoder_ms - ms.get("linear", 0.0)
            ms["sample"] = ms.get("rank", 0.0) - forward - ms.get("head", 0.0)
            for name in PARTS:
                probe.parts[probe.kind][name].append(ms.get(name, 0.0))
        return outputs

    engine._execute, engine.step = probed_execute, probed_step
    runner._forward = _timed(probe, "forward", runner._forward)
    runner.model.compute_logits = _timed(probe, "head", runner.model.compute_logits)
    if decoder is not None:
        decoder.forward = _timed(probe, "decoder", decoder.forward)
    return probe


def report(name: str, probe: StepProbe) -> dict[str, float]:
    """Prints the engine's table; returns mean step ms and tokens per step over decode steps."""
    print(f"\n{name}: mean ms per step")
    print(f"{'kind':>16} {'steps':>6} {'tok/step':>8} " + " ".join(f"{p:>7}" for p in PARTS))
    total_ms = total_steps = total_tokens = 0
    for kind, parts in sorted(probe.parts.items()):
        steps = len(parts["step"])
        means = [statistics.fmean(parts[p]) for p in PARTS]
        per_step = probe.tokens[kind] / steps
        print(f"{kind:>16} {steps:6d} {per_step:8.2f} " + " ".join(f"{m:7.2f}" for m in means))
        if kind != "prefill":
            total_ms += sum(parts["step"])
            total_steps += steps
            total_tokens += probe.tokens[kind]
    step_ms = total_ms / max(total_steps, 1)
    per_step = total_tokens / max(total_steps, 1)
    print(f"{'decode steps':>16} {total_steps:6d} {per_step:8.2f} {step_ms:7.2f}")
    return {"step_ms": step_ms, "tokens_per_step": per_step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: the default model)")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=None, help="prompt_lookup_min")
    parser.add_argument("--lookup-max", type=int, default=None, help="prompt_lookup_max")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=1, help="requests per engine, in turn")
    args = parser.parse_args()
    spec: dict = {"method": "ngram", "num_speculative_tokens": args.k}
    if args.lookup_min is not None:
        spec["prompt_lookup_min"] = args.lookup_min
    if args.lookup_max is not None:
        spec["prompt_lookup_max"] = args.lookup_max
    engines = {"plain": LLM(args.model), "ngram": LLM(args.model, speculative_config=spec)}
    probes = {}
    for name, llm in engines.items():
        decode_rate(llm, 1, 16)  # warm-up, unprobed
        probes[name] = install(llm, name != "plain")
    for _ in range(args.repeats):
        for llm in engines.values():
            decode_rate(llm, 1, args.max_tokens)
    summary = {name: report(name, probe) for name, probe in probes.items()}
    stats = engines["ngram"].engine.spec.stats
    accepted = stats.num_accepted_tokens / max(stats.num_draft_tokens, 1)
    print(
        f"\nngram: {stats.num_drafts} verifying steps, {stats.num_accepted_tokens}/"
        f"{stats.num_draft_tokens} proposals accepted ({accepted:.0%}), mean accepted length "
        f"{stats.mean_accepted_length:.2f}, accepted per position {stats.accepted_per_position}"
    )
    plain, ngram = summary["plain"], summary["ngram"]
    cost = ngram["step_ms"] / plain["step_ms"]
    print(
        f"ngram step costs {cost:.2f}x a plain one and yields {ngram['tokens_per_step']:.2f} "
        f"tokens: {ngram['tokens_per_step'] / cost:.2f}x plain decoding"
    )


if __name__ == "__main__":
    main()
