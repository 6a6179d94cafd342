"""What a verifying decode step of r rows (r - 1 proposals and the sequence's last token) costs
against a plain 1-row step, one sequence, TP=1: the figure that bounds speculative decoding's
gain (tokens per step / cost of the step).

Every step of a request proposes r - 1 fixed tokens (rejected; the acceptance off-switch is
held open), r from 1 to --max-rows, in interleaved rounds. Reported per r: the median step in
process CPU time (steadier than wall time on a shared machine; run with one thread,
OMP_NUM_THREADS=1, for a figure that contention barely moves), its ratio to r = 1, and the
fused decoder's quantized/bf16 linear share (wall).

    OMP_NUM_THREADS=1 python perf/bench_spec_rows.py [--model PATH] [--max-rows 9]
        [--rounds 3] [--tokens 24]

Default model: the default model, on bench_spec.py's rewrite prompt.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_spec import prompt_ids  # noqa: E402

from cpud import LLM, SamplingParams  # noqa: E402

FILLER = 42  # the proposed token: any id in the vocabulary


class FixedProposals:
    """An n-gram index stand-in proposing `count` fixed tokens whatever the sequence."""

    def __init__(self) -> None:
        self.count = 0

    def propose(self, tokens: list[int], k: int) -> list[int]:
        return [FILLER] * min(k, self.count)


def hold_open(llm: LLM, proposals: FixedProposals) -> None:
    """Every sequence's state proposes through `proposals` and never pauses."""
    spec = llm.engine.spec
    make_state = spec._state

    def state(seq):
        held = make_state(seq)
        held.index, held.paused, held.acceptance = proposals, 0, 1.0
        return held

    spec._state = state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: the default model)")
    parser.add_argument("--max-rows", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=24, help="decode steps per request")
    args = parser.parse_args()
    k = args.max_rows - 1
    llm = LLM(args.model, speculative_config={"method": "ngram", "num_speculative_tokens": k})
    proposals = FixedProposals()
    hold_open(llm, proposals)
    engine, decoder = llm.engine, llm.engine.executor.runner.decoder
    prompt = prompt_ids(llm, 0, "rewrite")
    # room for every proposal: max_tokens covers the last step's k proposals
    params = SamplingParams(temperature=0, max_tokens=args.tokens + k + 1)
    cpu: dict[int, list[float]] = {r: [] for r in range(1, args.max_rows + 1)}
    linear: dict[int, list[float]] = {r: [] for r in cpu}
    for round_ in range(args.rounds + 1):  # round 0: warm-up
        for rows in cpu:
            proposals.count = rows - 1
            engine.add_request(f"rows{rows}-{round_}", prompt, params)
            engine.step()  # the prompt (a prefix hit after the first round)
            for _ in range(args.tokens):
                before = decoder.linear_seconds if decoder is not None else 0.0
                started = time.process_time()
                engine.step()
                if round_:
                    cpu[rows].append(time.process_time() - started)
                    if decoder is not None:
                        linear[rows].append(decoder.linear_seconds - before)
            engine.abort(f"rows{rows}-{round_}")
            while engine.has_unfinished():
                engine.step()
    base = statistics.median(cpu[1])
    print(f"{'rows':>4} {'cpu ms':>8} {'x 1 row':>8} {'linear wall ms':>14}")
    for rows, values in cpu.items():
        step = statistics.median(values)
        lin = statistics.median(linear[rows]) * 1e3 if linear[rows] else float("nan")
        print(f"{rows:4d} {step * 1e3:8.2f} {step / base:8.2f} {lin:14.2f}")


if __name__ == "__main__":
    main()
