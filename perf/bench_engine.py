"""End-to-end engine throughput: cpud vs Hugging Face transformers, interleaved (A B A B).

    python perf/bench_engine.py                        # all scenarios, qwen3-0.6b preset
    python perf/bench_engine.py --scenario decode-1 --rounds 5

Peers: transformers (eager, same weights) and, with --llamacpp, llama.cpp's llama-bench on a
bf16 GGUF converted from the same directory (perf/peers/llamacpp.py).
Scenarios: decode-1 (one stream), decode-32 (32 streams in lockstep), prefill-512 (one
512-token prompt). Decode tok/s counts generated tokens after the first step; prefill tok/s
counts prompt tokens of one forward pass. Each figure is the median over rounds; ratios are
computed round by round. Results: perf/results/engine.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from cpud import LLM, SamplingParams
from cpud.fixtures import make_model
from cpud.fixtures.cache import cache_root

RESULTS = Path(__file__).parent / "results"
SCENARIOS = ("decode-1", "decode-32", "prefill-512")


def model_dir(arch: str, preset: str, given: str | None) -> Path:
    if given:
        return Path(given)
    path = cache_root() / "perf" / f"{arch}-{preset}"
    if not (path / "config.json").is_file():
        make_model(arch, preset, path)
    return path


def prompts(count: int, length: int, salt: int = 0) -> list[list[int]]:
    return [[(7 * i + 13 * s + salt) % 1000 + 10 for i in range(length)] for s in range(count)]


SALTS = iter(range(1, 1 << 30))


def cpud_decode(llm: LLM, streams: int, prompt_len: int, tokens: int) -> float:
    engine = llm.engine
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for index, prompt in enumerate(prompts(streams, prompt_len, next(SALTS))):
        engine.add_request(f"d{index}", prompt, params)
    engine.step()  # the prefill step also samples each stream's first token
    started = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return streams * (tokens - 1) / (time.perf_counter() - started)


def cpud_prefill(llm: LLM, length: int) -> float:
    engine = llm.engine
    # A fresh prompt each run: a prefix-cache hit would skip the work being measured.
    engine.add_request("p", prompts(1, length, next(SALTS))[0], SamplingParams(max_tokens=1))
    started = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return length / (time.perf_counter() - started)


@torch.inference_mode()
def hf_decode(model, streams: int, prompt_len: int, tokens: int) -> float:
    ids = torch.tensor(prompts(streams, prompt_len))
    out = model(input_ids=ids, use_cache=True)
    past = out.past_key_values
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    started = time.perf_counter()
    for _ in range(tokens - 1):
        out = model(input_ids=token, past_key_values=past, use_cache=True)
        past = out.past_key_values
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    return streams * (tokens - 1) / (time.perf_counter() - started)


@torch.inference_mode()
def hf_prefill(model, length: int) -> float:
    ids = torch.tensor(prompts(1, length))
    started = time.perf_counter()
    model(input_ids=ids, use_cache=True, logits_to_keep=1)
    return length / (time.perf_counter() - started)


def llamacpp_peer(path: Path):
    """(module, gguf) for llama.cpp built from the llama-cpp-python sdist, or (None, reason)."""
    sys.path.insert(0, str(Path(__file__).parent / "peers"))
    try:
        import llamacpp

        llamacpp.ensure_built()
        gguf = llamacpp.gguf_path(path)
        if not gguf.is_file():
            llamacpp.convert(path, gguf)
        return llamacpp, gguf
    except Exception as exc:  # reported, never silently skipped
        return None, f"{type(exc).__name__}: {exc}"


def runners(
    scenario: str, llm: LLM, hf, llama, tokens: int, threads: int
) -> dict[str, Callable[[], float]]:
    module, gguf = llama if llama else (None, None)
    if scenario == "prefill-512":
        result = {"cpud": lambda: cpud_prefill(llm, 512)}
        if hf is not None:
            result["transformers"] = lambda: hf_prefill(hf, 512)
        if module is not None:
            result["llama.cpp"] = lambda: module.bench_prefill(gguf, 512, threads, 1)["tok_s"]
        return result
    streams = int(scenario.split("-")[1])
    result = {"cpud": lambda: cpud_decode(llm, streams, 32, tokens)}
    if hf is not None:
        result["transformers"] = lambda: hf_decode(hf, streams, 32, tokens)
    if module is not None and streams == 1:
        result["llama.cpp"] = lambda: module.bench_decode(gguf, threads, tokens, 32, 1)["tok_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3")
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--model", help="model directory (default: generated preset)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kernels", default="auto", choices=("auto", "native", "torch"))
    parser.add_argument("--scenario", choices=SCENARIOS, action="append")
    parser.add_argument("--tokens", type=int, default=64, help="generated tokens per stream")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    parser.add_argument(
        "--llamacpp", action="store_true", help="also run llama.cpp (built on first use)"
    )
    args = parser.parse_args()

    path = model_dir(args.arch, args.preset, args.model)
    started = time.perf_counter()
    llm = LLM(path, dtype=args.dtype, max_model_len=1024, kernels=args.kernels)
    load_seconds = time.perf_counter() - started
    hf = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    llama = None
    if args.llamacpp:
        llama = llamacpp_peer(path)
        if llama[0] is None:
            print(f"llama.cpp could not run: {llama[1]}")
    summary: dict = {
        "model": str(path),
        "dtype": args.dtype,
        "kernels": llm.engine.executor.runner.ops.name,
        "threads": torch.get_num_threads(),
        "cpud_load_s": load_seconds,
        "scenarios": {},
        "loadavg_start": os.getloadavg()[0],
    }
    if llama is not None and llama[0] is None:
        summary["llama.cpp_error"] = llama[1]
    for scenario in args.scenario or SCENARIOS:
        engines = runners(scenario, llm, hf, llama, args.tokens, torch.get_num_threads())
        for fn in engines.values():  # warm-up
            fn()
        rounds = []
        for _ in range(args.rounds):
            rounds.append({name: fn() for name, fn in engines.items()})
        row = {name: statistics.median(r[name] for r in rounds) for name in engines}
        peers = [name for name in engines if name != "cpud"]
        for peer in peers:
            row[f"ratio_vs_{peer}"] = statistics.median(r["cpud"] / r[peer] for r in rounds)
        row["rounds"] = rounds
        summary["scenarios"][scenario] = row
        text = "".join(
            f", {peer} {row[peer]:.1f} tok/s (cpud {row[f'ratio_vs_{peer}']:.2f}x)"
            for peer in peers
        )
        print(f"{scenario}: cpud {row['cpud']:.1f} tok/s{text}", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "engine.json").write_text(json.dumps(summary, indent=2))
    summary["loadavg_end"] = os.getloadavg()[0]
    print(
        f"cpud load {load_seconds:.1f} s; kernels {summary['kernels']}; load average "
        f"{summary['loadavg_start']:.2f} -> {summary['loadavg_end']:.2f}; results in {RESULTS}"
    )


if __name__ == "__main__":
    main()
