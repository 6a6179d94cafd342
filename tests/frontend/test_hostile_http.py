"""Hostile HTTP input: wrong content types, template kwargs that break rendering, prompts far
beyond the context, bodies cut off mid-send, and handler failures. Each gets an OpenAI-shaped
error that is counted in cpud_requests_total, the log gets one line at most, and the server
keeps serving."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from cpud.frontend.app import create_app, guarded
from cpud.frontend.errors import APIError
from cpud.frontend.state import Phase, ServerConfig, ServerState
from cpud.text.tokenizer import Tokenizer
from cpud_server_helpers import rank_pids, start_server

OK_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
OK_PROMPT = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


def requests_counted(server, endpoint: str, status: int) -> float:
    wanted = f'cpud_requests_total{{endpoint="{endpoint}",status="{status}"}}'
    for line in httpx.get(server.base_url + "/metrics").text.splitlines():
        if line.startswith(wanted):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def still_serving(server) -> None:
    assert httpx.post(server.base_url + "/v1/completions", json=OK_PROMPT, timeout=30).is_success
    assert httpx.get(server.base_url + "/health").status_code == 200


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_json_routes_refuse_other_content_types(server, path, content_type):
    body = OK_CHAT if "chat" in path else OK_PROMPT
    if path == "/tokenize":  # generates nothing: max_tokens is no field of it
        body = {k: v for k, v in body.items() if k != "max_tokens"}
    headers = {} if content_type is None else {"content-type": content_type}
    before = requests_counted(server, path, 415)
    response = httpx.post(
        server.base_url + path,
        content=httpx.Request("POST", "/", json=body).content,
        headers=headers,
    )
    error = assert_openai_error(response, 415)
    assert error["code"] == "unsupported_media_type"
    assert "application/json" in error["message"]
    assert requests_counted(server, path, 415) == before + 1
    ok = httpx.post(
        server.base_url + path,
        json=body,
        headers={"content-type": "application/json; charset=utf-8"},
    )
    assert ok.status_code == 200


@pytest.mark.parametrize(
    "kwargs, words",
    [({"self": 1}, "'self'"), ({"messages": []}, "'messages'")],
)
def test_reserved_chat_template_kwargs_are_400(server, kwargs, words):
    before = requests_counted(server, "/v1/chat/completions", 400)
    response = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={**OK_CHAT, "chat_template_kwargs": kwargs},
    )
    error = assert_openai_error(response, 400, "chat_template_kwargs")
    assert words in error["message"]
    assert requests_counted(server, "/v1/chat/completions", 400) == before + 1
    still_serving(server)


def test_deeply_nested_body_is_400_not_500(server):
    depth = 100_000
    raw = (
        b'{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"a":'
        + b"[" * depth
        + b"]" * depth
        + b"}}"
    )
    before = requests_counted(server, "/v1/chat/completions", 400)
    response = httpx.post(
        server.base_url + "/v1/chat/completions",
        content=raw,
        headers={"content-type": "application/json"},
    )
    error = assert_openai_error(response, 400)
    assert "nested too deeply" in error["message"]
    assert requests_counted(server, "/v1/chat/completions", 400) == before + 1
    assert "Traceback" not in server.log()
    still_serving(server)


@pytest.mark.parametrize("path, field", [("/v1/completions", "prompt"), ("/tokenize", "prompt")])
def test_prompt_beyond_any_context_is_refused_before_tokenizing(server, path, field):
    huge = "All work and no play makes Jack a dull boy. " * 90_000  # ~4 MB
    started = time.monotonic()
    response = httpx.post(server.base_url + path, json={field: huge}, timeout=60)
    elapsed = time.monotonic() - started
    error = assert_openai_error(response, 400, field)
    assert error["code"] == "context_length_exceeded"
    assert "characters" in error["message"]
    # tokenizing 4 MB takes seconds here; refusing it by its length takes no tokenizer time
    assert elapsed < 2.0, elapsed
    chat = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={**OK_CHAT, "messages": [{"role": "user", "content": huge}]},
        timeout=60,
    )
    assert assert_openai_error(chat, 400, "messages")["code"] == "context_length_exceeded"


def test_body_cut_off_mid_send_logs_at_most_one_line(server):
    before = server.log()
    url = urlparse(server.base_url)
    for _ in range(3):
        with socket.create_connection((url.hostname, url.port)) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
                + b'{"prompt": "'
                + b"a" * 1000
            )
            time.sleep(0.1)
    time.sleep(0.5)
    still_serving(server)
    added = server.log()[len(before) :]
    assert "Traceback" not in added
    assert len([line for line in added.splitlines() if "disconnect" in line.lower()]) <= 3


class Broken:
    """A handler that fails the way an unexpected bug would."""

    async def __call__(self, request, state):
        raise KeyError("something nobody planned for")


def test_unexpected_handler_failure_is_a_counted_openai_500(model_factory, caplog):
    state = ServerState(ServerConfig(("tiny",), 256), Tokenizer(model_factory("qwen3")))
    state.phase = Phase.READY
    try:
        app = Starlette(routes=[Route("/boom", guarded(state, "/boom", Broken()))])
        with caplog.at_level(logging.ERROR, logger="cpud.frontend"):
            response = TestClient(app).get("/boom")
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["type"] == "internal_error" and "KeyError" in error["message"]
        counted = state.metrics.requests.labels("/boom", "500")._value.get()
        assert counted == 1
        records = [r for r in caplog.records if r.name == "cpud.frontend"]
        assert len(records) == 1 and "\n" not in records[0].getMessage()
        assert records[0].exc_info is None
    finally:
        state.close()


def test_tokenizing_runs_off_the_event_loop(model_factory):
    """A long prompt is tokenized on a worker thread while the loop keeps ticking."""
    state = ServerState(ServerConfig(("tiny",), 256), Tokenizer(model_factory("qwen3")))
    text = "All work and no play makes Jack a dull boy. " * 40_000

    async def run() -> tuple[float, float]:
        gaps: list[float] = []
        done = asyncio.Event()

        async def tick() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        started = time.perf_counter()
        await state.off_loop(state.tokenizer.encode, text)
        took = time.perf_counter() - started
        done.set()
        await ticker
        return took, max(gaps)

    try:
        took, worst_gap = asyncio.run(run())
    finally:
        state.close()
    assert worst_gap < max(0.25, took / 3), (took, worst_gap)


def test_health_turns_503_while_a_stopped_rank_makes_no_progress(model_factory, tmp_path):
    srv = start_server(
        model_factory("qwen3"),
        tmp_path / "serve.log",
        "--max-model-len",
        "256",
        "--stall-timeout",
        "1",
    )
    try:
        (rank,) = rank_pids(srv.proc.pid)
        os.kill(rank, signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(
                    httpx.post,
                    srv.base_url + "/v1/completions",
                    json={**OK_PROMPT, "max_tokens": 4},
                    timeout=60,
                )
                deadline = time.monotonic() + 10
                health = httpx.get(srv.base_url + "/health")
                while health.status_code == 200 and time.monotonic() < deadline:
                    time.sleep(0.1)
                    health = httpx.get(srv.base_url + "/health")
                assert health.status_code == 503, health.text
                assert health.json()["status"].startswith("stalled")
                os.kill(rank, signal.SIGCONT)
                assert pending.result().status_code == 200
        finally:
            os.kill(rank, signal.SIGCONT)
        assert httpx.get(srv.base_url + "/health").status_code == 200
    finally:
        srv.stop()


@pytest.mark.parametrize("flag", ["--stall-timeout", "--step-timeout", "--drain-timeout"])
def test_non_positive_timeouts_are_config_errors(model_factory, flag):
    result = subprocess.run(
        [sys.executable, "-m", "cpud.cli", "serve", "--model", str(model_factory("qwen3"))]
        + [flag, "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == f"cpud: error: {flag} must be a positive number of seconds, got 0.0"
    )


def test_a_body_that_stops_arriving_is_a_408_and_frees_its_slot(model_factory):
    """A client that sends the start of a large body and then stalls gets 408 after
    body_seconds; its pacing slot is released for the next body."""
    state = ServerState(
        ServerConfig(("tiny",), 256, body_seconds=0.3, paced_body_bytes=8, paced_bodies=1),
        Tokenizer(model_factory("qwen3")),
    )
    state.phase = Phase.READY
    app = create_app(state)
    sent: list[dict] = []

    async def receive() -> dict:
        if not sent:
            sent.append({})
            return {"type": "http.request", "body": b'{"prompt": "' + b"a" * 64, "more_body": True}
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/tokenize",
        "raw_path": b"/tokenize",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
    }

    async def run() -> None:
        await asyncio.wait_for(app(scope, receive, send), 5)
        await asyncio.wait_for(state.body_pacer.take_slot(), 1)  # the slot came back

    try:
        asyncio.run(run())
    finally:
        state.close()
    start = next(m for m in sent if m.get("type") == "http.response.start")
    assert start["status"] == 408


def test_too_many_requests_waiting_for_the_tokenizer_is_a_429(model_factory):
    state = ServerState(
        ServerConfig(("tiny",), 256, max_tokenizing=0), Tokenizer(model_factory("qwen3"))
    )
    try:
        with pytest.raises(APIError) as info:
            asyncio.run(state.off_loop(state.tokenizer.encode, "hi"))
    finally:
        state.close()
    assert info.value.status == 429 and info.value.code == "queue_full"
