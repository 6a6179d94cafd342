"""Load: 64 concurrent streaming requests for half a minute against `--tp 2` on loopback.
Zero errors, every stream complete, KV usage back to zero, rank memory flat.
CPUD_LOAD_SECONDS shortens the run for local iteration."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import httpx

from cpud_server_helpers import metric, rank_pids, start_server

CONCURRENCY = 64
DURATION_S = float(os.environ.get("CPUD_LOAD_SECONDS", "30"))


def rss_bytes(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def one_stream(client: httpx.AsyncClient, index: int) -> tuple[bool, str]:
    body = {
        "prompt": f"load test {index} " * (1 + index % 7),
        "max_tokens": 8 + index % 24,
        "temperature": 0.8,
        "seed": index,
        "stream": True,
    }
    events: list[str] = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return False, f"status {response.status_code}"
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    if not events or events[-1] != "[DONE]":
        return False, "no [DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    if any("error" in c for c in chunks):
        return False, "error event"
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    if not reasons or reasons[-1] not in ("stop", "length"):
        return False, f"unfinished: {reasons[-1:]}"
    return True, ""


async def drive(base_url: str, deadline: float) -> tuple[int, list[str]]:
    done = 0
    errors: list[str] = []
    limits = httpx.Limits(max_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:

        async def worker(slot: int) -> None:
            nonlocal done
            index = slot
            while time.monotonic() < deadline:
                ok, why = await one_stream(client, index)
                done += ok
                if not ok:
                    errors.append(why)
                index += CONCURRENCY

        await asyncio.gather(*(worker(slot) for slot in range(CONCURRENCY)))
    return done, errors


def test_64_concurrent_streams_for_half_a_minute_at_tp2(model_factory, tmp_path):
    srv = start_server(
        model_factory("qwen3"),
        tmp_path / "load.log",
        "--tp",
        "2",
        "--bind",
        "0|1",
        "--max-model-len",
        "256",
    )
    try:
        pids = rank_pids(srv.proc.pid)
        started = time.monotonic()
        # Warm up for a tenth of the run, then take the memory baseline.
        done, errors = asyncio.run(drive(srv.base_url, started + DURATION_S / 10))
        baseline = {pid: rss_bytes(pid) for pid in pids}
        more, more_errors = asyncio.run(drive(srv.base_url, time.monotonic() + DURATION_S * 0.9))
        done += more
        errors += more_errors
        assert errors == [], errors[:5]
        assert done >= CONCURRENCY
        deadline = time.monotonic() + 10
        while metric(srv, "cpud_kv_cache_usage_ratio") != 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric(srv, "cpud_kv_cache_usage_ratio") == 0
        assert metric(srv, "cpud_requests_running") == 0
        for pid in pids:
            growth = rss_bytes(pid) - baseline[pid]
            assert growth < 32 << 20, f"rank pid {pid} grew {growth >> 20} MiB under load"
        assert srv.stop() == 0
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
