"""cpud and llama.cpp on one GGUF file: the same prompt (token ids, no template), greedy, and the
top log-probabilities of each generated token from both (cpud's model runner, as a rank runs
it; llama.cpp's llama-server /completion with n_probs): a check that both read the file alike,
not a parity test.

Two known differences besides rounding: llama.cpp computes activations in fp32 (cpud serves
bf16 by default: --dtype float32 to match), and llama.cpp always rounds YaRN's correction range
to whole dimensions while gpt-oss's config asks for none (truncate false, as transformers and
cpud run it): --yarn-truncate runs cpud with llama.cpp's rounding.

    python perf/bench_moe_check.py --gguf FILE [--steps 8] [--threads 2]
    python perf/bench_moe_check.py --gguf FILE --dtype float32 --yarn-truncate
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))

import llamacpp  # noqa: E402

TOP = 5
PROMPT = [17, 29, 41, 53, 97, 101, 151, 199, 211, 307, 401, 499]  # within every fixture vocab


def cpud_run(gguf: Path, steps: int, dtype: str, yarn_truncate: bool) -> dict[str, Any]:
    """Greedy tokens and, per step, {token id: logprob} of the top TOP, from a model runner
    (one rank, native kernels) on the file, its YaRN rounded as llama.cpp rounds it if asked."""
    import dataclasses

    import torch

    from cpud.model.load import load_model_config
    from cpud.protocol.step import SeqWork, StepPlan
    from cpud.ranks.model_runner import ModelRunner, RunnerConfig
    from cpud.ranks.parallel import SingleRank

    cfg = load_model_config(gguf)
    if yarn_truncate and cfg.recipe is not None:
        ropes = tuple(
            dataclasses.replace(r, scaling=r.scaling | {"truncate": True}) if r.scaling else r
            for r in cfg.recipe.ropes
        )
        cfg = dataclasses.replace(cfg, recipe=dataclasses.replace(cfg.recipe, ropes=ropes))
    blocks = -(-(len(PROMPT) + steps) // 16)
    config = RunnerConfig(
        gguf, getattr(torch, dtype), 256, 16, blocks, kernels="native", kv_pretouch=False
    )
    run = ModelRunner(config, cfg, SingleRank())
    table = list(range(blocks))
    tokens: list[int] = []
    top: list[dict[int, float]] = []
    work = SeqWork(0, list(PROMPT), 0, table, True)
    for i in range(steps):
        logits = run.prompt_logits(StepPlan(i, [work]))[-1]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        values, ids = logprobs.topk(TOP)
        top.append({int(t): float(v) for t, v in zip(ids, values)})
        tokens.append(int(ids[0]))
        work = SeqWork(0, [tokens[-1]], len(PROMPT) + i, table, True)
    return {"dtype": dtype, "yarn_truncate": yarn_truncate, "tokens": tokens, "top": top}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def llamacpp_run(gguf: Path, steps: int, threads: int) -> dict[str, Any]:
    """The same through llama-server (b11434)."""
    server = llamacpp.ensure_built() / "llama-server"
    port = _free_port()
    cmd = [str(server), "-m", str(gguf), "-t", str(threads), "-c", "256", "--port", str(port)]
    proc = subprocess.Popen(cmd + ["-np", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("llama-server did not become healthy in 600 s")
            time.sleep(1)
        body = {
            "prompt": PROMPT,
            "n_predict": steps,
            "temperature": 0,
            "top_k": 1,
            "n_probs": TOP,
            "cache_prompt": False,
            "return_tokens": True,
            "ignore_eos": True,
        }
        answer = _post(f"{base}/completion", body)
    finally:
        proc.terminate()
        proc.wait(30)
    steps_out = answer["completion_probabilities"]
    top = [{int(c["id"]): float(c["logprob"]) for c in s["top_logprobs"]} for s in steps_out]
    return {"tokens": [int(s["id"]) for s in steps_out], "top": top}


def compare(
    gguf: Path, steps: int, threads: int, dtype: str = "bfloat16", yarn_truncate: bool = False
) -> dict[str, Any]:
    """Both runs and their agreement: equal greedy prefix, and the largest difference of the
    logprob of a token both sides list in the first step's top TOP."""
    ours = cpud_run(gguf, steps, dtype, yarn_truncate)
    theirs = llamacpp_run(gguf, steps, threads)
    same = 0
    for a, b in zip(ours["tokens"], theirs["tokens"]):
        if a != b:
            break
        same += 1
    first_a, first_b = ours["top"][0], theirs["top"][0]
    shared = set(first_a) & set(first_b)
    diff = max((abs(first_a[t] - first_b[t]) for t in shared), default=math.nan)
    return {
        "gguf": str(gguf),
        "prompt": PROMPT,
        "cpud": ours,
        "llama.cpp": theirs,
        "equal_greedy_prefix": same,
        "steps": steps,
        "first_step_shared_top": len(shared),
        "first_step_max_logprob_diff": diff,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--yarn-truncate", action="store_true", help="YaRN rounded as llama.cpp does")
    args = ap.parse_args()
    result = compare(args.gguf, args.steps, args.threads, args.dtype, args.yarn_truncate)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
