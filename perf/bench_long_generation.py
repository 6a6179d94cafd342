"""Long generation: decode rate per 500-token window of one stream of 8192 output tokens, plain
and with `logprobs: 5`, through the HTTP server (engine, outputs, frontend and SSE included).

    python perf/bench_long_generation.py                  # the default model, 8192 tokens
    python perf/bench_long_generation.py --rounds 3 --model DIR_OR_GGUF --tokens 4096
    python perf/bench_long_generation.py --tokens 1000 --rounds 1        # smoke test

One `cpud serve` (the model's context, or --max-model-len) serves every run; after
a short warm-up, each round runs the plain stream, then the logprobs stream (A B A B across
rounds). Each run streams /v1/completions with ignore_eos and continuous usage, so every chunk
says how many tokens are out; a window's rate is 500 tokens over the time between the chunks
that crossed its two ends. The table gives each window's median rate over rounds, plain and
with logprobs, and their ratio (issue 34: the last window of a long stream with logprobs at
>= 0.8x the plain rate, and a late window of either at the rate attention allows, not one that
sinks with the output's length). Results: perf/results/long_generation.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from serving_server import Server, Target, base_env, free_port  # noqa: E402  perf/

RESULTS = HERE / "results"
WINDOW = 500
PROMPT = "Write a very long story about a lighthouse keeper and the sea, chapter by chapter."


def cpud_target(model: str | None, port: int, max_model_len: int | None, dtype: str) -> Target:
    cmd = ["cpud", "serve", "--host", "127.0.0.1", "--port", str(port)]
    if model:
        cmd += ["--model", model]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    cmd += ["--dtype", dtype, "--max-num-seqs", "4"]
    return Target("cpud", cmd, base_env(), port, model or "default", 300)


def served_model(url: str) -> tuple[str, int]:
    card = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]
    return card["id"], card["max_model_len"]


def stream_times(url: str, model: str, tokens: int, logprobs: int | None) -> list[float]:
    """Seconds from the request to the chunk that brought each output token's count up to
    k (index k - 1), from one streamed completion."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": tokens,
        "temperature": 0.8,
        "seed": 1,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if logprobs is not None:
        body["logprobs"] = logprobs
    times: list[float] = []
    started = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=None) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            usage = json.loads(line[6:]).get("usage") or {}
            count = usage.get("completion_tokens", 0)
            now = time.perf_counter() - started
            while len(times) < count:
                times.append(now)
    if len(times) < tokens:
        raise RuntimeError(f"the stream ended after {len(times)} of {tokens} tokens")
    return times


def window_rates(times: list[float]) -> list[float]:
    """Tokens per second of each full window of WINDOW tokens (the first starts at the first
    token, so prefill is left out)."""
    rates = []
    for start in range(0, len(times) - WINDOW, WINDOW):
        span = times[start + WINDOW] - times[start]
        rates.append(WINDOW / span if span > 0 else float("inf"))
    return rates


def run(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    target = cpud_target(args.model, port, args.max_model_len, args.dtype)
    server = Server(target, RESULTS / "logs")
    server.start()
    try:
        url = f"http://127.0.0.1:{port}"
        model, context = served_model(url)
        tokens = min(args.tokens, context - 64)
        stream_times(url, model, min(tokens, 64), None)  # warm-up
        rates: dict[str, list[list[float]]] = {"plain": [], "logprobs": []}
        for round_index in range(args.rounds):
            for name, logprobs in (("plain", None), ("logprobs", 5)):
                times = stream_times(url, model, tokens, logprobs)
                rates[name].append(window_rates(times))
                server.check_alive(f"round {round_index + 1}, {name}")
                print(f"round {round_index + 1} {name}: {tokens / times[-1]:.1f} tok/s overall")
    finally:
        server.stop()
    windows = []
    for index in range(min(len(r) for r in rates["plain"] + rates["logprobs"])):
        plain = statistics.median(r[index] for r in rates["plain"])
        with_logprobs = statistics.median(r[index] for r in rates["logprobs"])
        windows.append(
            {
                "first_token": index * WINDOW,
                "plain_tok_s": round(plain, 2),
                "logprobs_tok_s": round(with_logprobs, 2),
                "ratio": round(with_logprobs / plain, 3),
            }
        )
    return {"model": model, "tokens": tokens, "rounds": args.rounds, "windows": windows}


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"Long generation, {result['model']}: one stream of {result['tokens']} tokens, "
        f"median over {result['rounds']} round(s), tok/s per {WINDOW}-token window",
        "",
        "| tokens | plain | logprobs 5 | ratio |",
        "|---|---|---|---|",
    ]
    for w in result["windows"]:
        span = f"{w['first_token']}-{w['first_token'] + WINDOW}"
        lines.append(f"| {span} | {w['plain_tok_s']} | {w['logprobs_tok_s']} | {w['ratio']} |")
    if result["windows"]:
        first, last = result["windows"][0], result["windows"][-1]
        lines += [
            "",
            f"last window / first window: plain {last['plain_tok_s'] / first['plain_tok_s']:.2f}x,"
            f" logprobs {last['logprobs_tok_s'] / first['logprobs_tok_s']:.2f}x; logprobs / "
            f"plain in the last window {last['ratio']:.2f}x (goal >= 0.8x)",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model directory or GGUF (default model)")
    parser.add_argument("--tokens", type=int, default=8192, help="output tokens per stream")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="passed to cpud serve (default: the model's context); the stream's tokens are "
        "capped to the context less 64 (the default model: 8192 - 64)",
    )
    parser.add_argument("--json", type=Path, default=RESULTS / "long_generation.json")
    parser.add_argument("--markdown", type=Path, default=RESULTS / "long_generation.md")
    args = parser.parse_args(argv)
    result = run(args)
    text = markdown(result)
    print(text)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
