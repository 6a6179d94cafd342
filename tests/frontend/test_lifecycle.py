"""API key, client disconnect, full queue and SIGTERM drain, each on its own server."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from cpud_server_helpers import metric, start_server

LONG_STREAM = {
    "model": "tiny",
    "prompt": "go",
    "max_tokens": 240,
    "n": 16,
    "temperature": 1.0,
    "ignore_eos": True,
    "stream": True,
}


@pytest.fixture
def fresh(model_factory, tmp_path):
    servers = []

    def start(*extra: str, env: dict | None = None):
        srv = start_server(
            model_factory("qwen3"),
            tmp_path / f"s{len(servers)}.log",
            "--max-model-len",
            "256",
            *extra,
            env=env,
        )
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()


def test_api_key_denies_by_default(fresh):
    srv = fresh(env={"CPUD_API_KEY": "s3cret"})
    url = srv.base_url
    assert httpx.get(url + "/health").status_code == 200
    for path in (
        "/v1/models",
        "/openapi.json",
        "/tokenize",
        "/v1/../v1/models",
        "/health/../v1/models",
    ):
        response = httpx.request("GET" if "tokenize" not in path else "POST", url + path, json={})
        assert response.status_code == 401, path
        assert response.json()["error"]["code"] == "invalid_api_key"
    wrong = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    right = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer s3cret"})
    assert right.status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200  # open unless --metrics-need-key


def test_client_disconnect_aborts_and_frees_kv(fresh):
    srv = fresh()
    e2e_before = metric(srv, "cpud_e2e_request_latency_seconds_count")
    with httpx.stream("POST", srv.base_url + "/v1/completions", json=LONG_STREAM, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"]
        assert metric(srv, "cpud_kv_cache_usage_ratio") > 0
    # The connection is closed mid-stream: the request must be aborted and its blocks freed.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if (
            metric(srv, "cpud_requests_running") == 0
            and metric(srv, "cpud_kv_cache_usage_ratio") == 0
        ):
            break
        time.sleep(0.05)
    assert metric(srv, "cpud_requests_running") == 0
    assert metric(srv, "cpud_kv_cache_usage_ratio") == 0
    assert metric(srv, "cpud_e2e_request_latency_seconds_count") == e2e_before  # not completed
    ok = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_full_queue_gets_429_with_retry_after(fresh):
    srv = fresh("--max-pending-requests", "1")
    body = {**LONG_STREAM, "stream": False}
    holder = threading.Thread(
        target=lambda: httpx.post(srv.base_url + "/v1/completions", json=body, timeout=90)
    )
    holder.start()
    try:
        deadline = time.monotonic() + 10
        while metric(srv, "cpud_requests_running") == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        response = httpx.post(
            srv.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}
        )
        assert response.status_code == 429
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "queue_full"
    finally:
        holder.join()


def test_sigterm_drains_in_flight_requests(fresh):
    # Long enough (seconds, not tenths) that the drain cannot finish before the checks below.
    srv = fresh("--drain-timeout", "60", "--max-model-len", "1024")
    body = {**LONG_STREAM, "stream": False, "n": 16, "max_tokens": 1000}
    result: dict = {}

    def call() -> None:
        response = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=90)
        result["status"] = response.status_code
        result["body"] = response.json()

    worker = threading.Thread(target=call)
    worker.start()
    deadline = time.monotonic() + 10
    while metric(srv, "cpud_requests_running") == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    # Draining: health says so and new work is refused; the in-flight request still finishes.
    health = httpx.get(srv.base_url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "draining"
    refused = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert refused.status_code == 503
    worker.join(90)
    assert result["status"] == 200
    assert all(
        len(c["text"]) >= 0 and c["finish_reason"] == "length" for c in result["body"]["choices"]
    )
    assert result["body"]["usage"]["completion_tokens"] == 16 * 1000
    assert srv.proc.wait(30) == 0
