"""One measurement for perf/ab_revisions.py, run under the revision its PYTHONPATH selects:
decode tok/s of 1 and of 32 streams and prefill tok/s of one 512-token prompt on one rank
(native kernels, fused decoder), printed as one JSON line. Uses only APIs every compared
revision has.

    PYTHONPATH=IMPORT_ROOT python3 perf/ab_revisions_child.py MODEL STEPS THREADS
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from cpud.model.load import load_model_config
from cpud.protocol.step import SeqWork, StepPlan
from cpud.ranks.model_runner import ModelRunner, RunnerConfig
from cpud.ranks.parallel import SingleRank

BLOCK = 16
STREAMS = 32
PREFILL = 512


def decode(run: ModelRunner, streams: int, steps: int, first_id: int) -> float:
    per = -(-(steps + 24) // BLOCK)
    tables = [list(range(s * per, (s + 1) * per)) for s in range(streams)]
    ids = [first_id + s for s in range(streams)]
    run.execute(
        StepPlan(0, [SeqWork(i, [11 + s] * 16, 0, tables[s], True) for s, i in enumerate(ids)])
    )
    t0 = time.perf_counter()
    for step in range(steps):
        seqs = [SeqWork(i, [20 + step], 16 + step, tables[s], True) for s, i in enumerate(ids)]
        run.execute(StepPlan(1 + step, seqs))
    return streams * steps / (time.perf_counter() - t0)


def prefill(run: ModelRunner, tokens: int, first_id: int, rounds: int = 2) -> float:
    """Prompt tokens per second of one `tokens`-long prompt, the best of `rounds`."""
    table = list(range(-(-tokens // BLOCK)))
    prompt = [(37 * i + 11) % 500 + 3 for i in range(tokens)]
    best = 0.0
    for r in range(rounds):
        t0 = time.perf_counter()
        run.execute(StepPlan(r, [SeqWork(first_id + r, prompt, 0, table, True)]))
        best = max(best, tokens / (time.perf_counter() - t0))
    return best


def main() -> None:
    path, steps, threads = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(threads)
    blocks = max(STREAMS * (-(-(steps + 24) // BLOCK)), -(-PREFILL // BLOCK)) + 8
    config = RunnerConfig(
        path, torch.bfloat16, 1024, BLOCK, blocks, kernels="native", kv_pretouch=False
    )
    run = ModelRunner(config, load_model_config(path), SingleRank())
    if run.decoder is None:
        raise SystemExit(f"{path}: the fused decoder is not in use")
    decode(run, 1, 8, 0)  # warm-up
    result = {
        "decode_1": decode(run, 1, steps, 100),
        "decode_32": decode(run, STREAMS, max(4, steps // 4), 200),
        "prefill_512": prefill(run, PREFILL, 300),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
