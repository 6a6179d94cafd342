"""Constrained decoding's cost: 8 concurrent chat streams with a JSON schema against the same
streams unconstrained, one server, interleaved rounds; and grammar compile time for the
structured-output test table.

    python3 perf/bench_structured.py --rounds 3 --seconds 20 [--model DIR|FILE]

Each round runs both modes for `--seconds` each (order alternating round by round), every
client sending its next request when the previous one ends (closed loop at `--concurrency`).
Output tok/s counts completion tokens from the server's usage over the measured window, so a
constrained request that ends early (its grammar complete) is followed by the next one and no
capacity is lost to idling. The ratio constrained / unconstrained is computed per round. The
default model is the real SmolLM2 (a random-weight model writes JSON strings that never end).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from bench_prompt_flood import free_port, serve  # noqa: E402
from structured_schemas import SCHEMAS  # noqa: E402

ITEM_SCHEMA = {
    "type": "object",
    "properties": {
        "cities": {
            "type": "array",
            "minItems": 4,
            "maxItems": 8,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "country": {"type": "string", "maxLength": 24},
                    "population_millions": {"type": "number", "minimum": 0, "maximum": 40},
                },
                "required": ["name", "country", "population_millions"],
            },
        }
    },
    "required": ["cities"],
}
PROMPTS = [
    "List some large European cities with their country and population.",
    "Name big cities in Asia, with country and population in millions.",
    "Give me cities in South America with their countries and populations.",
    "Which are the largest cities in Africa? Country and population, please.",
]


def request_body(model: str, index: int, constrained: bool, max_tokens: int) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPTS[index % len(PROMPTS)]}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": index,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if constrained:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "cities", "schema": ITEM_SCHEMA, "strict": True},
        }
    return body


async def one_stream(client: httpx.AsyncClient, url: str, body: dict) -> int:
    tokens = 0
    async with client.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            usage = json.loads(line[6:]).get("usage")
            if usage:
                tokens = usage["completion_tokens"]
    return tokens


async def closed_loop(
    base: str, constrained: bool, concurrency: int, seconds: float, max_tokens: int
) -> dict:
    """Output tok/s of requests that finished within the window, plus the count."""
    url = f"{base}/v1/chat/completions"
    model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
    deadline = time.perf_counter() + seconds
    counts: list[int] = []

    async def client_loop(cid: int, client: httpx.AsyncClient) -> None:
        n = 0
        while time.perf_counter() < deadline:
            counts.append(
                await one_stream(
                    client, url, request_body(model, cid * 1000 + n, constrained, max_tokens)
                )
            )
            n += 1

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(client_loop(c, client) for c in range(concurrency)))
    wall = time.perf_counter() - start
    return {"tok_s": sum(counts) / wall, "requests": len(counts), "wall_s": wall}


def compile_times(model: str | None) -> dict:
    """Median and max compile seconds of the schema table on a fresh compiler (no cache hits)."""
    from cpud.model.default_model import default_model_path
    from cpud.structured.compiler import GrammarCompiler
    from cpud.structured.spec import StructuredSpec
    from cpud.text.tokenizer import Tokenizer

    tokenizer = Tokenizer(model or default_model_path())
    compiler = GrammarCompiler(tokenizer)
    started = time.perf_counter()
    compiler.ll_tokenizer()
    tokenizer_s = time.perf_counter() - started
    seconds = []
    for schema in SCHEMAS.values():
        spec = StructuredSpec("json", json.dumps(schema))
        started = time.perf_counter()
        compiler.matcher(spec)
        seconds.append(time.perf_counter() - started)
    return {
        "schemas": len(seconds),
        "median_ms": 1e3 * statistics.median(seconds),
        "max_ms": 1e3 * max(seconds),
        "tokenizer_s": tokenizer_s,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    compiles = compile_times(args.model)
    print(
        f"compile: {compiles['schemas']} schemas, median {compiles['median_ms']:.2f} ms, "
        f"max {compiles['max_ms']:.2f} ms (tokenizer conversion {compiles['tokenizer_s']:.2f} s)"
    )
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--max-model-len", "2048", "--kv-cache-space", "1"]
        flags += ["--model", args.model] if args.model else []
        proc = serve(flags, port, Path(tmp) / "serve.log", timeout=180)
        base = f"http://127.0.0.1:{port}"
        rounds = []
        try:
            asyncio.run(closed_loop(base, True, args.concurrency, 3, 32))  # warm up both paths
            asyncio.run(closed_loop(base, False, args.concurrency, 3, 32))
            for r in range(args.rounds):
                order = (True, False) if r % 2 == 0 else (False, True)
                res = {}
                for constrained in order:
                    res[constrained] = asyncio.run(
                        closed_loop(
                            base, constrained, args.concurrency, args.seconds, args.max_tokens
                        )
                    )
                ratio = res[True]["tok_s"] / res[False]["tok_s"]
                rounds.append({"json": res[True], "free": res[False], "ratio": ratio})
                print(
                    f"round {r + 1}: json {res[True]['tok_s']:.1f} tok/s "
                    f"({res[True]['requests']} requests), free {res[False]['tok_s']:.1f} tok/s "
                    f"({res[False]['requests']} requests): {ratio:.3f}x"
                )
        finally:
            proc.terminate()
            proc.wait(60)
    ratios = [r["ratio"] for r in rounds]
    print(
        f"constrained / unconstrained output tok/s at {args.concurrency} streams: median "
        f"{statistics.median(ratios):.3f}x (rounds {', '.join(f'{x:.3f}' for x in ratios)})"
    )
    if args.out:
        args.out.write_text(json.dumps({"compile": compiles, "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
