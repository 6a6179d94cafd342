"""Decode throughput, 1 stream: cpud vs Hugging Face transformers, interleaved (A B A B).

    python perf/bench_decode.py --preset qwen3-0.6b --tokens 64 --rounds 3

Prefill is timed separately; decode tok/s counts tokens after the first. Each figure is the
median over rounds; the ratio is computed round by round. Results: perf/results/decode.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from cpud import LLM, SamplingParams
from cpud.fixtures import make_model
from cpud.fixtures.cache import cache_root

RESULTS = Path(__file__).parent / "results"


def model_dir(arch: str, preset: str, given: str | None) -> Path:
    if given:
        return Path(given)
    path = cache_root() / "perf" / f"{arch}-{preset}"
    if not (path / "config.json").is_file():
        make_model(arch, preset, path)
    return path


def cpud_decode(llm: LLM, prompt: list[int], tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode tokens/s) for one stream."""
    engine = llm.engine
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    engine.add_request("bench", prompt, params)
    start = time.perf_counter()
    engine.step()
    first = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    end = time.perf_counter()
    return first - start, (tokens - 1) / (end - first)


@torch.inference_mode()
def hf_decode(model, prompt: list[int], tokens: int) -> tuple[float, float]:
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    out = model(input_ids=ids, use_cache=True)
    token = out.logits[0, -1].argmax().view(1, 1)
    first = time.perf_counter()
    past = out.past_key_values
    for _ in range(tokens - 1):
        out = model(input_ids=token, past_key_values=past, use_cache=True)
        past = out.past_key_values
        token = out.logits[0, -1].argmax().view(1, 1)
    end = time.perf_counter()
    return first - start, (tokens - 1) / (end - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3")
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--model", help="model directory (default: generated preset)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    args = parser.parse_args()

    path = model_dir(args.arch, args.preset, args.model)
    dtype = getattr(torch, args.dtype)
    load_start = time.perf_counter()
    llm = LLM(path, dtype=args.dtype, max_model_len=args.prompt_len + args.tokens + 16)
    load_seconds = time.perf_counter() - load_start
    hf = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    prompt = [(7 * i) % 1000 + 10 for i in range(args.prompt_len)]
    cpud_decode(llm, prompt, 4)  # warm-up
    if hf is not None:
        hf_decode(hf, prompt, 4)
    rows = []
    for round_index in range(args.rounds):
        row = {"round": round_index}
        row["cpud_prefill_s"], row["cpud_tok_s"] = cpud_decode(llm, prompt, args.tokens)
        if hf is not None:
            row["hf_prefill_s"], row["hf_tok_s"] = hf_decode(hf, prompt, args.tokens)
            row["ratio"] = row["cpud_tok_s"] / row["hf_tok_s"]
        rows.append(row)
        print(json.dumps(row))
    summary = {
        "model": str(path),
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "prompt_len": args.prompt_len,
        "tokens": args.tokens,
        "cpud_load_s": load_seconds,
        "cpud_tok_s": statistics.median(r["cpud_tok_s"] for r in rows),
        "rounds": rows,
    }
    if hf is not None:
        summary["hf_tok_s"] = statistics.median(r["hf_tok_s"] for r in rows)
        summary["ratio_vs_hf"] = statistics.median(r["ratio"] for r in rows)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "decode.json").write_text(json.dumps(summary, indent=2))
    print(
        f"decode 1 stream, {args.dtype}, {summary['threads']} threads: cpud "
        f"{summary['cpud_tok_s']:.1f} tok/s"
        + (
            f", transformers {summary['hf_tok_s']:.1f} tok/s, ratio {summary['ratio_vs_hf']:.2f}x"
            if hf is not None
            else ""
        )
        + f" (cpud load {load_seconds:.1f} s)"
    )


if __name__ == "__main__":
    main()
