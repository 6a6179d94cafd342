"""`cpud serve --tp 2 --bind 0|1`: serves like tp=1, fails in-flight requests promptly when a
rank dies and exits non-zero for a restart, drains on SIGTERM; never leaves a process behind."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from cpud_server_helpers import rank_pids, start_server

TP2 = ("--tp", "2", "--bind", "0|1", "--max-model-len", "256")


@pytest.fixture
def tp2(model_factory, tmp_path):
    servers = []

    def start():
        srv = start_server(model_factory("qwen3"), tmp_path / "tp2.log", *TP2)
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()


def test_tp2_serves_what_tp1_serves(tp2, server):
    body = {"prompt": "The same answer", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    one = httpx.post(server.base_url + "/v1/completions", json=body).json()
    srv = tp2()
    assert len(rank_pids(srv.proc.pid)) == 2
    two = httpx.post(srv.base_url + "/v1/completions", json=body).json()
    assert two["choices"][0]["text"] == one["choices"][0]["text"]
    # Per-rank series, labelled by rank and NUMA node, arrive within about a second of work.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        httpx.post(srv.base_url + "/v1/completions", json=body)
        text = httpx.get(srv.base_url + "/metrics").text
        if all(f'cpud_rank_steps_total{{numa_node="0",rank="{r}"}}' in text for r in "01"):
            break
    for rank in ("0", "1"):
        labels = f'{{numa_node="0",rank="{rank}"}}'
        rank_lines = [line for line in text.splitlines() if line.startswith("cpud_rank")]
        assert f"cpud_rank_threads_bound{labels} 1.0" in text, rank_lines
        assert f"cpud_rank_kv_cache_bytes{labels}" in text
        assert f"cpud_rank_allreduce_seconds_total{labels}" in text
    pids = rank_pids(srv.proc.pid)
    assert srv.stop(signal.SIGTERM) == 0
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)


def test_rank_death_ends_streams_with_an_error_and_exits_nonzero(tp2):
    srv = tp2()
    pids = rank_pids(srv.proc.pid)
    body = {"prompt": "go", "max_tokens": 240, "n": 8, "ignore_eos": True, "stream": True}
    events = []
    started = time.monotonic()
    with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 2:
                os.kill(pids[1], signal.SIGKILL)
    assert time.monotonic() - started < 15
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_dead" and "rank 1" in error["message"]
    assert srv.proc.wait(15) == 3
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)


def test_sigterm_drains_in_flight_requests_at_tp2(tp2):
    import threading

    srv = tp2()
    pids = rank_pids(srv.proc.pid)
    body = {"prompt": "go", "max_tokens": 200, "n": 4, "ignore_eos": True}
    result: dict = {}

    def call() -> None:
        response = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=60)
        result["status"], result["body"] = response.status_code, response.json()

    worker = threading.Thread(target=call)
    worker.start()
    time.sleep(0.3)
    srv.proc.send_signal(signal.SIGTERM)
    worker.join(60)
    assert result["status"] == 200
    assert result["body"]["usage"]["completion_tokens"] == 4 * 200
    assert srv.proc.wait(30) == 0
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
