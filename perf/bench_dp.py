"""Serving throughput of three layouts of the same model on the same cores, 32 concurrent
clients (closed loop, perf/loadgen.py's built-in generator, streaming /v1/completions):

    dp2     cpud -dp 2: two replicas of one core each (16 clients on each replica's port, or all
            32 through vllm-router with --via router)
    1x2     cpud --tp 1: one replica, one rank of two cores
    tp2     cpud --tp 2: one replica, two ranks of one core each (shared-memory all-reduce)

    python perf/bench_dp.py --rounds 3
    python perf/bench_dp.py --prefix --policies cache_aware round_robin kv_aware

Rounds are interleaved (dp2 1x2 tp2 dp2 1x2 tp2 ...), one server alive at a time; each round
reports every layout's output tok/s and its ratio to 1x2 measured in the same round. Results:
perf/results/dp.json. Run it on a quiet machine: it measures.

--prefix: `cpud -dp 2 --router` under each vllm-router policy (kv_aware with cpud's KV-cache
events), a multi-turn chat workload (perf/dp_conversations.py): many conversations at once, each
over a long document of its own, every turn resending the history. --workload evicting (the
default) sizes each replica's KV cache to 0.6 of the conversations' working set, so a replica
holds more than half of them but not all; --workload earlier is the shape measured first (1 GiB
per replica). Per policy: the prefix-cache hit rate from the replicas' metrics
(cpud_prefix_cache_hits / cpud_prefix_cache_queries, summed over the `replica` label), the
share of prompt tokens the answers' usage reports cached, output tok/s, and each policy's ratio
to round_robin; policies interleave within each round. The result states the cache size and
the working set. Results: perf/results/dp_prefix.json.

The layouts use --kv-cache-space 2 per rank (the qwen3-0.6b-shaped fixture's 32 streams of
256 + 128 tokens need 1.3 GiB on one rank).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import loadgen  # noqa: E402
from bench_engine import model_dir  # noqa: E402
from dp_conversations import WORKLOADS, Workload, cache_size, conversations  # noqa: E402
from serving_server import Server, Target, base_env, free_port  # noqa: E402

RESULTS = HERE / "results"
LAYOUTS = ("dp2", "1x2", "tp2")
BASELINE = "1x2"


def command(
    layout: str, model: Path, port: int, via: str, kv_gib: float, max_model_len: int = 4096
) -> list[str]:
    cmd = ["cpud", "serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--dtype", "bfloat16", "--kv-cache-space", f"{kv_gib:.6f}", "--max-num-seqs", "32"]
    cmd += ["--max-model-len", str(max_model_len)]
    cmd += ["--served-model-name", "bench", "--no-kv-cache-pretouch"]
    if layout == "dp2":
        cmd += ["--data-parallel-size", "2"]
        if via == "router":
            cmd += ["--router", "--router-args", "--policy round_robin"]
    elif layout == "tp2":
        cmd += ["--tp", "2"]
    return cmd


def client_urls(layout: str, port: int, via: str) -> list[str]:
    """Where the clients send: each replica's port (clients split evenly) or the one port."""
    if layout == "dp2" and via == "split":
        return [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
    return [f"http://127.0.0.1:{port}"]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def wait_ready(urls: list[str], server: Server, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not all(healthy(u) for u in urls):
        server.check_alive("the start")
        if time.monotonic() > deadline:
            raise RuntimeError(f"not ready after {timeout:.0f} s: {server.tail()}")
        time.sleep(0.2)


def load(urls: list[str], clients: int, requests: int, isl: int, osl: int) -> dict[str, Any]:
    """Closed-loop load over `urls` at once, clients and requests split evenly; one figure:
    every stream's tokens over the longest wall time."""
    share = clients // len(urls)
    with ThreadPoolExecutor(len(urls)) as pool:
        parts = list(
            pool.map(
                lambda url: loadgen.run_builtin(
                    url, "bench", share, requests // len(urls), isl, osl, warmup=2
                ),
                urls,
            )
        )
    wall = max(p["duration_s"] for p in parts)
    tokens = sum(p["output_tok_s"] * p["duration_s"] for p in parts)
    ttft = [p["ttft_p50_s"] for p in parts]
    return {
        "output_tok_s": tokens / wall,
        "request_s": sum(p["completed"] for p in parts) / wall,
        "ttft_p50_s": statistics.mean(ttft),
        "ttft_p99_s": max(p["ttft_p99_s"] for p in parts),
        "itl_p50_s": statistics.mean(p["itl_p50_s"] for p in parts),
        "per_url": parts,
    }


def run_layout(layout: str, model: Path, args: argparse.Namespace, log_dir: Path) -> dict:
    port = free_port()
    cmd = command(layout, model, port, args.via, args.kv_cache_space)
    target = Target(layout, cmd, base_env(), port, "bench")
    server = Server(target, log_dir)
    try:
        server.start()
        urls = client_urls(layout, port, args.via)
        wait_ready(urls, server)
        result = load(urls, args.clients, args.requests, args.isl, args.osl)
        server.check_alive("the load")
        result["command"] = " ".join(target.cmd)
        result["load_average_1m_after"] = os.getloadavg()[0]  # other work on the machine
        return result
    finally:
        server.stop()


def router_command(model: Path, port: int, policy: str, kv_port: int, kv_gib: float) -> list[str]:
    cmd = command("dp2", model, port, "router", kv_gib, max_model_len=4096)
    cmd[cmd.index("--router-args") + 1] = f"--policy {policy}"
    if policy == "kv_aware":
        config = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{kv_port}"}
        cmd += ["--kv-events-config", json.dumps(config)]
    return cmd


def counter(text: str, name: str) -> float:
    """A counter summed over its labels (every replica's) in a Prometheus exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "_total ", name + "_total{")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def prefix_figures(urls: list[str]) -> dict[str, float]:
    hits = queries = 0.0
    for url in urls:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
            text = reply.read().decode()
        hits += counter(text, "cpud_prefix_cache_hits")
        queries += counter(text, "cpud_prefix_cache_queries")
    return {"prefix_hits": hits, "prefix_queries": queries}


def run_policy(policy: str, model: Path, work: Workload, cache: dict, log_dir: Path) -> dict:
    port = free_port()
    cmd = router_command(model, port, policy, free_port(), cache["kv_cache_space_gib"])
    server = Server(Target(f"router-{policy}", cmd, base_env(), port, "bench"), log_dir)
    replicas = [f"http://127.0.0.1:{port + 1}", f"http://127.0.0.1:{port + 2}"]
    try:
        server.start()
        wait_ready([server.target.url, *replicas], server)
        before = prefix_figures(replicas)
        load = asyncio.run(conversations(server.target.url, work))
        server.check_alive("the load")
        after = prefix_figures(replicas)
        hits = after["prefix_hits"] - before["prefix_hits"]
        queries = after["prefix_queries"] - before["prefix_queries"]
        figures = {"hit_rate": hits / max(queries, 1), "prefix_queries": queries}
        return {**load, **figures, "load_average_1m_after": os.getloadavg()[0]}
    finally:
        server.stop()


def prefix_workload(args: argparse.Namespace) -> Workload:
    work = WORKLOADS[args.workload]
    given = {
        "conversations": args.conversations,
        "turns": args.turns,
        "words": args.words,
        "cache_share": args.cache_share,
    }
    return replace(work, **{k: v for k, v in given.items() if v is not None})


def prefix_main(args: argparse.Namespace, model: Path, log_dir: Path) -> None:
    work = prefix_workload(args)
    cache = cache_size(model, work)
    print(
        f"{work.name}: {work.conversations} conversations x {work.turns} turns, working set "
        f"~{cache['working_set_tokens_estimate']} tokens, KV cache "
        f"{cache['cache_tokens_per_replica']} tokens per replica",
        flush=True,
    )
    rounds = []
    for index in range(args.rounds):
        results = {p: run_policy(p, model, work, cache, log_dir) for p in args.policies}
        base = results.get("round_robin")
        for policy, result in results.items():
            if base:
                result["hit_rate_vs_round_robin"] = result["hit_rate"] / max(base["hit_rate"], 1e-9)
                result["tok_s_vs_round_robin"] = result["output_tok_s"] / base["output_tok_s"]
            print(
                f"round {index + 1} {policy}: prefix hit rate {result['hit_rate']:.1%} "
                f"(cached prompt tokens {result['cached_share_of_prompt_tokens']:.1%}), "
                f"{result['output_tok_s']:.1f} tok/s, working set {result['working_set_tokens']}",
                flush=True,
            )
        rounds.append(results)
    summary = {}
    for policy in args.policies:
        summary[policy] = {
            key: statistics.median(r[policy][key] for r in rounds)
            for key in ("hit_rate", "cached_share_of_prompt_tokens", "output_tok_s")
        }
    base = summary.get("round_robin")
    for row in summary.values():
        if base:
            row["hit_rate_vs_round_robin"] = row["hit_rate"] / max(base["hit_rate"], 1e-9)
            row["tok_s_vs_round_robin"] = row["output_tok_s"] / base["output_tok_s"]
    measured = statistics.median(r[p]["working_set_tokens"] for r in rounds for p in r)
    cache["working_set_tokens_measured"] = measured
    cache["cache_over_working_set"] = cache["cache_tokens_per_replica"] / measured
    out = args.json if args.json != RESULTS / "dp.json" else RESULTS / "dp_prefix.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"model": str(model), "workload": asdict(work), "cache": cache}
    report |= {"args": {**vars(args), "json": str(out)}, "summary": summary, "rounds": rounds}
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(
        f"KV cache per replica {cache['cache_tokens_per_replica']} tokens, working set "
        f"{measured:.0f} tokens ({cache['cache_over_working_set']:.2f}x)"
    )
    print("| policy | prefix hit rate | vs round_robin | output tok/s | vs round_robin |")
    print("|---|---|---|---|---|")
    for policy, row in summary.items():
        print(
            f"| {policy} | {row['hit_rate']:.1%} | {row.get('hit_rate_vs_round_robin', 0):.2f}x "
            f"| {row['output_tok_s']:.1f} | {row.get('tok_s_vs_round_robin', 0):.2f}x |"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3")
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--model", help="a model directory instead of the fixture")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--via", choices=("split", "router"), default="split")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--isl", type=int, default=256)
    parser.add_argument("--osl", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=RESULTS / "dp.json")
    parser.add_argument("--prefix", action="store_true", help="router policies, multi-turn chat")
    parser.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin", "kv_aware"])
    parser.add_argument("--kv-cache-space", type=float, default=2.0, help="GiB per rank")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="evicting")
    parser.add_argument("--conversations", type=int, help="--prefix: instead of the workload's")
    parser.add_argument("--turns", type=int, help="--prefix: instead of the workload's")
    parser.add_argument("--words", type=int, help="--prefix: document words, instead of ...")
    parser.add_argument("--cache-share", type=float, help="--prefix: KV cache / working set")
    args = parser.parse_args(argv)
    model = model_dir(args.arch, args.preset, args.model)
    log_dir = Path("/tmp") / "cpud-bench-dp"
    if args.prefix:
        prefix_main(args, model, log_dir)
        return
    rounds: list[dict[str, dict]] = []
    for index in range(args.rounds):
        results = {layout: run_layout(layout, model, args, log_dir) for layout in args.layouts}
        base = results.get(BASELINE, {}).get("output_tok_s")
        for layout, result in results.items():
            ratio = result["output_tok_s"] / base if base else None
            result["ratio_to_1x2"] = ratio
            shown = f" ({ratio:.2f}x 1x2)" if ratio else ""
            print(
                f"round {index + 1} {layout}: {result['output_tok_s']:.1f} tok/s{shown}, "
                f"TTFT p50 {result['ttft_p50_s']:.2f} s",
                flush=True,
            )
        rounds.append(results)
    summary = {
        layout: {
            "output_tok_s_median": statistics.median(r[layout]["output_tok_s"] for r in rounds),
            "ratio_to_1x2_median": (
                statistics.median(r[layout]["ratio_to_1x2"] for r in rounds)
                if BASELINE in args.layouts
                else None
            ),
        }
        for layout in args.layouts
    }
    report = {"model": str(model), "args": {**vars(args), "json": str(args.json)}}
    report |= {"summary": summary, "rounds": rounds}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print("| layout | output tok/s (median) | vs 1x2 |\n|---|---|---|")
    for layout, row in summary.items():
        ratio = row["ratio_to_1x2_median"]
        print(f"| {layout} | {row['output_tok_s_median']:.1f} | {ratio and f'{ratio:.2f}x'} |")


if __name__ == "__main__":
    main()
