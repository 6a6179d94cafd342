"""A streaming client's inter-token latency, idle and while other clients flood the server with
huge prompts: one large prompt must cost its sender, not everyone.

    python3 perf/bench_prompt_flood.py [--model DIR] [--flooders 16] [--prompt-mb 4] [--json]

Starts `cpud serve` on loopback (a generated Qwen3-0.6B-shaped fixture unless --model is given),
then runs rounds of: a streaming completion alone (idle), and the same completion while `flooders`
clients each send `prompt-mb` MB prompts back to back (flood). Idle and flood rounds alternate
(A B A B) and the inter-token gaps of each kind are pooled. Reports p50 / p99 of both, their
ratio, how many flood requests were answered and with what status, and how much the
frontend's RSS grew.
Target: flood p99 under 2x idle p99.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def frontend_rss_bytes(supervisor_pid: int) -> int:
    """RSS of the supervisor's child that runs cpud.frontend.server."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
            statm = (entry / "statm").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == supervisor_pid and b"cpud.frontend.server" in cmdline:
            return int(statm.split()[1]) * os.sysconf("SC_PAGE_SIZE")
    raise RuntimeError("no frontend process found")


def serve(flags: list[str], port: int, log: Path, timeout: float = 120) -> subprocess.Popen:
    """`cpud serve --port PORT FLAGS...` with its output in log, once /health answers 200."""
    cmd = [sys.executable, "-m", "cpud.cli", "serve", "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-5:])
            raise SystemExit(f"cpud serve exited {proc.returncode}:\n{tail}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"cpud serve did not become healthy: see {log}")


def start(model: Path, port: int, args: argparse.Namespace, log: Path) -> subprocess.Popen:
    flags = ["--model", str(model), "--max-model-len", str(args.max_model_len)]
    flags += ["--dtype", args.dtype, "--kv-cache-space", "1"]
    return serve(flags, port, log)


async def stream_gaps(client: httpx.AsyncClient, tokens: int) -> list[float]:
    body = {
        "prompt": "The quick brown fox",
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    stamps: list[float] = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:])]


async def flood(
    client: httpx.AsyncClient, payload: bytes, stop: asyncio.Event, statuses: list[int]
) -> None:
    headers = {"content-type": "application/json"}
    while not stop.is_set():
        response = await client.post("/v1/completions", content=payload, headers=headers)
        statuses.append(response.status_code)


async def measure(base_url: str, args: argparse.Namespace, supervisor_pid: int) -> dict:
    text = ("All work and no play makes Jack a dull boy. " * (1 << 20))[: int(args.prompt_mb * 1e6)]
    payload = json.dumps({"prompt": text, "max_tokens": 1}).encode()
    idle: list[float] = []
    flooded: list[float] = []
    statuses: list[int] = []
    limits = httpx.Limits(max_connections=args.flooders + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
        await stream_gaps(client, 8)  # warm-up
        rss_before = frontend_rss_bytes(supervisor_pid)
        for _ in range(args.rounds):
            idle += await stream_gaps(client, args.tokens)
            stop = asyncio.Event()
            flooders = [
                asyncio.create_task(flood(client, payload, stop, statuses))
                for _ in range(args.flooders)
            ]
            await asyncio.sleep(0.5)  # the flood is under way before the stream starts
            flooded += await stream_gaps(client, args.tokens)
            stop.set()
            await asyncio.gather(*flooders)
    growth = frontend_rss_bytes(supervisor_pid) - rss_before
    return {"idle": idle, "flood": flooded, "statuses": statuses, "rss_growth": growth}


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="model directory (default: a fixture)")
    parser.add_argument(
        "--preset", default="qwen3-0.6b", help="fixture shape when no --model (tiny for a check)"
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--flooders", type=int, default=16)
    parser.add_argument("--prompt-mb", type=float, default=4.0)
    parser.add_argument("--tokens", type=int, default=64, help="tokens of the measured stream")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cpud-flood-") as tmp:
        model = args.model
        if model is None:
            from cpud.fixtures import make_model

            model = make_model("qwen3", args.preset, Path(tmp) / "model", dtype=args.dtype)
        port = free_port()
        proc = start(model, port, args, Path(tmp) / "serve.log")
        try:
            result = asyncio.run(measure(f"http://127.0.0.1:{port}", args, proc.pid))
            healthy = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code
        finally:
            proc.terminate()
            proc.wait(60)
    idle, flooded = result["idle"], result["flood"]
    summary = {
        "idle_itl_p50_ms": statistics.median(idle) * 1e3,
        "idle_itl_p99_ms": p(idle, 0.99) * 1e3,
        "flood_itl_p50_ms": statistics.median(flooded) * 1e3,
        "flood_itl_p99_ms": p(flooded, 0.99) * 1e3,
        "p99_ratio": p(flooded, 0.99) / p(idle, 0.99),
        "flood_requests": len(result["statuses"]),
        "flood_statuses": sorted(set(result["statuses"])),
        "frontend_rss_growth_mb": result["rss_growth"] / 1e6,
        "health_after": healthy,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        for key, value in summary.items():
            print(f"{key:24} {value:.2f}" if isinstance(value, float) else f"{key:24} {value}")
        print(f"target: flood p99 < 2x idle p99: {'met' if summary['p99_ratio'] < 2 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
