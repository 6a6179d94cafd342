"""Load generators for perf/bench_serving.py: aiperf (PyPI, own venv) and a small built-in one.

Both drive an OpenAI-compatible server with streaming /v1/completions at a fixed concurrency
(closed loop: `concurrency` clients, each sending its next request when the previous one ends)
and return the same figures:

    output_tok_s      completion tokens (as the server's usage reports them) / wall seconds
    request_s         completed requests / wall seconds
    ttft_p50_s, ttft_p99_s   time to the first streamed token
    itl_p50_s         inter-token latency per request, (latency - TTFT) / (tokens - 1), median
    completion_tokens per-request counts seen (all == max_tokens when ignore_eos works)

aiperf (NVIDIA's load generator) is installed once into ~/.cache/cpud/peers/aiperf-venv so its
dependencies stay out of cpud's environment. It runs offline with the fixture directory as its
tokenizer, with one catch in aiperf 0.13.0: HF_HUB_OFFLINE=1 / TRANSFORMERS_OFFLINE=1 make it
look the path up as a Hub repo id ("HFValidationError: Repo id must be in the form 'repo_name'
or 'namespace/repo_name'"), so those variables are removed from its environment; a local path
never reaches the Hub without them. Its prompts are text from its own corpus, tokenized with
the fixture tokenizer to exactly `isl` tokens; token counts come from the server's usage
(--use-server-token-count), because random-weight models emit token strings that do not
re-tokenize to the same count.

aiperf 0.13.0 with --concurrency alone (its CONCURRENCY_BURST mode, zero interval) busy-waits:
its timing_manager process loops "no slot available -> yield to the event loop -> retry" and
burns 60-70% of a core for the whole run (py-spy: RequestRateStrategy.execute_phase ->
CreditIssuer.try_issue_credit / yield_to_event_loop), which on a 2-core machine is taken from
the server under test. So it runs with `--request-rate 200 --arrival-pattern constant` as well:
a new request may start every 5 ms while fewer than `concurrency` are in flight, which keeps the
loop closed at the given concurrency (the servers sustain a few requests per second) and cuts
the timing manager to ~5% of a core. The only change is that the first `concurrency` requests
go out over concurrency x 5 ms (160 ms at 32) instead of at once.

The built-in generator (asyncio + httpx) sends token-id prompts of exactly `isl` tokens and is
used when aiperf cannot be installed or run; results say which one produced them.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

AIPERF = "aiperf==0.13.0"
PACING_RATE = 200  # requests/s: aiperf may start a request every 5 ms while below --concurrency


def log(msg: str) -> None:
    print(f"[loadgen] {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    env = os.environ.get("CPUD_CACHE_DIR")
    return (Path(env) if env else Path.home() / ".cache" / "cpud") / "peers"


def ensure_aiperf(spec: str = AIPERF) -> Path:
    """The aiperf executable in its own venv, installed once (~2 min); raises on failure."""
    venv = cache_dir() / "aiperf-venv"
    stamp = venv / ".cpud-installed.json"
    exe = venv / "bin" / "aiperf"
    if stamp.is_file() and json.loads(stamp.read_text()).get("spec") == spec and exe.is_file():
        return exe
    shutil.rmtree(venv, ignore_errors=True)
    started = time.perf_counter()
    for cmd in (
        [sys.executable, "-m", "venv", str(venv)],
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", spec],
    ):
        log("$ " + " ".join(cmd))
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-5:])
            raise RuntimeError(f"`{' '.join(cmd[:5])}` failed: {tail}")
    seconds = round(time.perf_counter() - started, 1)
    stamp.write_text(json.dumps({"spec": spec, "install_s": seconds}) + "\n")
    log(f"installed {spec} in {seconds:.0f} s")
    return exe


def aiperf_install_info() -> dict[str, Any] | None:
    stamp = cache_dir() / "aiperf-venv" / ".cpud-installed.json"
    return json.loads(stamp.read_text()) if stamp.is_file() else None


def _metric(data: dict, name: str, stat: str = "avg") -> float | None:
    value = data.get(name)
    return value.get(stat) if isinstance(value, dict) else None


def run_aiperf(
    url: str,
    model: str,
    tokenizer: Path,
    concurrency: int,
    requests: int,
    out_dir: Path,
    isl: int = 256,
    osl: int = 128,
    warmup: int = 0,
    timeout_s: float = 1800,
) -> dict[str, Any]:
    """One aiperf profile run; raises RuntimeError with aiperf's own error on failure."""
    exe = ensure_aiperf()
    # aiperf runs with cwd=out_dir, so a relative artifact dir would nest inside itself.
    out_dir = out_dir.resolve()
    shutil.rmtree(out_dir, ignore_errors=True)
    cmd = [str(exe), "profile", "--model", model, "--url", url, "--endpoint-type", "completions"]
    cmd += ["--streaming", "--tokenizer", str(tokenizer), "--use-server-token-count"]
    cmd += ["--prompt-input-tokens-mean", str(isl), "--prompt-input-tokens-stddev", "0"]
    cmd += ["--prompt-output-tokens-mean", str(osl), "--prompt-output-tokens-stddev", "0"]
    cmd += ["--extra-inputs", "ignore_eos:true", "--concurrency", str(concurrency)]
    # Concurrency alone makes aiperf's timing manager spin (see the module docstring); a rate
    # far above what a 2-core server sustains, capped by --concurrency, keeps the loop closed.
    cmd += ["--request-rate", str(PACING_RATE), "--arrival-pattern", "constant"]
    cmd += ["--request-count", str(requests), "--warmup-request-count", str(warmup)]
    cmd += ["--output-artifact-dir", str(out_dir), "--ui-type", "none", "--no-server-metrics"]
    cmd += ["--random-seed", "0"]
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    env.pop("PYTHONPATH", None)
    log("$ " + " ".join(cmd))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "aiperf.stdout", "w") as sink:
        done = subprocess.run(
            cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, timeout=timeout_s, cwd=out_dir
        )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    export = out_dir / "profile_export_aiperf.json"
    if done.returncode != 0 or not export.is_file():
        text = (out_dir / "aiperf.stdout").read_text(errors="replace").strip().splitlines()
        errors = [line for line in text if "Error" in line or "error" in line] or text
        raise RuntimeError(f"aiperf exited {done.returncode}: " + " | ".join(errors[-4:]))
    data = json.loads(export.read_text())
    tokens = [
        json.loads(line)["metrics"].get("usage_completion_tokens", {}).get("value")
        for line in (out_dir / "profile_export.jsonl").read_text().splitlines()
        if '"benchmark_phase":"profiling"' in line
    ]
    ttft = {s: _metric(data, "time_to_first_token", s) for s in ("p50", "p99")}
    return {
        "loadgen": "aiperf",
        "output_tok_s": _metric(data, "output_token_throughput"),
        "request_s": _metric(data, "request_throughput"),
        "ttft_p50_s": ttft["p50"] / 1000 if ttft["p50"] is not None else None,
        "ttft_p99_s": ttft["p99"] / 1000 if ttft["p99"] is not None else None,
        "itl_p50_s": (_metric(data, "inter_token_latency", "p50") or 0) / 1000 or None,
        "completed": _metric(data, "completed_request_count"),
        "error_rate_pct": _metric(data, "request_error_rate"),
        "duration_s": _metric(data, "benchmark_duration"),
        "completion_tokens": sorted(set(t for t in tokens if t is not None)),
        "loadgen_cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
        "artifacts": str(out_dir),
    }


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    data = sorted(values)
    if len(data) == 1:
        return data[0]
    pos = (len(data) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (pos - low)


def prompt_ids(index: int, isl: int, salt: int) -> list[int]:
    return [(7 * i + 13 * index + 31 * salt) % 1000 + 10 for i in range(isl)]


async def _one(client: Any, url: str, body: dict) -> dict[str, Any]:
    sent = time.perf_counter()
    first = last = None
    usage = None
    chunks = 0
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")[:300]
            raise RuntimeError(f"HTTP {response.status_code}: {text}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            event = json.loads(payload)
            if event.get("usage"):
                usage = event["usage"]
            choices = event.get("choices") or []
            if choices and (choices[0].get("text") or choices[0].get("finish_reason") is None):
                now = time.perf_counter()
                first = first or now
                last = now
                chunks += 1
    if first is None or last is None:
        raise RuntimeError("stream ended without a token")
    tokens = (usage or {}).get("completion_tokens") or chunks
    itl = (last - first) / (tokens - 1) if tokens > 1 else 0.0
    return {"ttft": first - sent, "itl": itl, "tokens": tokens, "latency": last - sent}


async def _builtin(
    url: str, model: str, concurrency: int, requests: int, isl: int, osl: int, warmup: int
) -> dict[str, Any]:
    import httpx

    salt = int(time.time() * 1000) % 100_000  # fresh prompts: no prefix-cache hits across runs
    endpoint = url.rstrip("/") + "/v1/completions"

    def body(index: int, max_tokens: int) -> dict:
        return {
            "model": model,
            "prompt": prompt_ids(index, isl, salt),
            "max_tokens": max_tokens,  # no temperature: the server's default, as aiperf sends
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:
        if warmup:
            await asyncio.gather(
                *(_one(client, endpoint, body(10_000 + i, 8)) for i in range(warmup))
            )
        queue: asyncio.Queue[int] = asyncio.Queue()
        for index in range(requests):
            queue.put_nowait(index)
        results: list[dict[str, Any]] = []

        async def client_loop() -> None:
            while True:
                try:
                    index = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results.append(await _one(client, endpoint, body(index, osl)))

        started = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    ttfts = [r["ttft"] for r in results]
    return {
        "loadgen": "builtin",
        "output_tok_s": sum(r["tokens"] for r in results) / wall,
        "request_s": len(results) / wall,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": statistics.median(r["itl"] for r in results),
        "completed": len(results),
        "error_rate_pct": 0.0,
        "duration_s": wall,
        "completion_tokens": sorted({r["tokens"] for r in results}),
    }


def run_builtin(
    url: str,
    model: str,
    concurrency: int,
    requests: int,
    isl: int = 256,
    osl: int = 128,
    warmup: int = 0,
) -> dict[str, Any]:
    """The built-in closed-loop generator (asyncio + httpx, token-id prompts)."""
    return asyncio.run(_builtin(url, model, concurrency, requests, isl, osl, warmup))
