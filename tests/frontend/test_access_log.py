"""What an operator reads in the daemon's log: one access line per request whatever its status,
whether the API key is on, placement warnings at WARNING, "Running on" once, and a closing
line after a drain."""

from __future__ import annotations

import re
import signal
import time

import httpx
import pytest

from cpud_server_helpers import start_server

KEY = "access-log-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Two ranks bound to CPUs 0 and 1 share a memory node: the binding plan warns about it.
ARGS = ("--tp", "2", "--bind", "0|1", "--max-model-len", "256")
ACCESS = re.compile(r" cpud\.access (INFO|ERROR) (\S+) \"(\S+) (\S+)\" (\d+|-) ([\d.]+)s(.*)$")


@pytest.fixture(scope="module")
def keyed(model_factory, tmp_path_factory):
    srv = start_server(
        model_factory("qwen3"),
        tmp_path_factory.mktemp("access") / "serve.log",
        *ARGS,
        env={"CPUD_API_KEY": KEY},
    )
    yield srv
    if srv.proc.poll() is None:
        srv.proc.kill()
        srv.proc.wait()


def access_lines(log: str, path: str) -> list[re.Match]:
    found = (ACCESS.search(line) for line in log.splitlines())
    return [m for m in found if m is not None and m.group(4) == path]


def wait_for_line(srv, path: str, count: int) -> list[re.Match]:
    """The access lines of `path` once there are `count` (the line follows the answer)."""
    deadline = time.monotonic() + 10
    while True:
        lines = access_lines(srv.log(), path)
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def test_one_access_line_per_request_with_tokens_and_errors(keyed):
    base = keyed.base_url
    body = {"model": "tiny", "prompt": "secret prompt words", "max_tokens": 3, "ignore_eos": True}
    ok = httpx.post(base + "/v1/completions", json=body, headers=AUTH)
    assert ok.status_code == 200
    request_id = ok.json()["id"]
    bad = httpx.post(base + "/v1/chat/completions", json={"messages": 3}, headers=AUTH)
    assert bad.status_code == 400
    denied = httpx.get(base + "/v1/models")
    assert denied.status_code == 401
    missing = httpx.get(base + "/no/such/route", headers=AUTH)
    assert missing.status_code == 404

    [done] = wait_for_line(keyed, "/v1/completions", 1)
    assert done.group(1) == "INFO" and done.group(3) == "POST" and done.group(5) == "200"
    assert done.group(2).startswith("127.0.0.1:")
    assert f"id={request_id}" in done.group(7)
    assert "model=tiny" in done.group(7)
    usage = ok.json()["usage"]
    assert f"prompt_tokens={usage['prompt_tokens']} completion_tokens=3" in done.group(7)

    [rejected] = wait_for_line(keyed, "/v1/chat/completions", 1)
    assert rejected.group(5) == "400" and "error=" in rejected.group(7)
    [unauthorized] = wait_for_line(keyed, "/v1/models", 1)
    assert unauthorized.group(5) == "401" and "invalid_api_key" in unauthorized.group(7)
    [unknown] = wait_for_line(keyed, "/no/such/route", 1)
    assert unknown.group(5) == "404"

    log = keyed.log()
    assert "secret prompt words" not in log
    # An error answer is its access line, not a second line of its own.
    assert "-> 400" not in log and "-> 404" not in log and "-> 401" not in log


def test_a_streamed_answer_logs_its_tokens_when_it_ends(keyed):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 4, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", keyed.base_url + "/v1/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 200
        r.read()
    lines = wait_for_line(keyed, "/v1/completions", 2)
    assert "completion_tokens=4" in lines[-1].group(7)


def test_a_responses_answer_logs_its_id_and_tokens(keyed):
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2}
    answer = httpx.post(keyed.base_url + "/v1/responses", json=body, headers=AUTH).json()
    [line] = wait_for_line(keyed, "/v1/responses", 1)
    usage = answer["usage"]
    assert line.group(5) == "200" and f"id={answer['id']} model=tiny" in line.group(7)
    tokens = f"prompt_tokens={usage['input_tokens']} completion_tokens={usage['output_tokens']}"
    assert tokens in line.group(7)


def test_start_lines_say_it_once(keyed):
    log = keyed.log()
    assert log.count("Running on http://") == 1
    [ready] = [line for line in log.splitlines() if " ready in " in line and "serving" in line]
    assert re.search(r"cpud\.supervisor INFO ready in [\d.]+ s: serving tiny on http://", ready)
    [key_line] = [line for line in log.splitlines() if "cpud.frontend INFO API key" in line]
    assert "API key on" in key_line and KEY not in log
    warnings = [line for line in log.splitlines() if " WARNING " in line]
    assert any(re.search(r"WARNING binding: ranks 0.1 share NUMA node", w) for w in warnings)
    assert "warning:" not in log.replace("cpud: warning:", "")


def test_drain_ends_with_a_closing_line(keyed):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
    url = keyed.base_url + "/v1/completions"
    with httpx.stream("POST", url, json=body, headers=AUTH, timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it is running
        keyed.proc.send_signal(signal.SIGTERM)
        assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"
    assert keyed.stop() == 0
    log = keyed.log()
    closing = re.search(r"drained in [\d.]+ s: (\d+) request\(s\) finished, (\d+) cut", log)
    assert closing is not None, log[-2000:]
    assert closing.groups() == ("1", "0")
    assert len(re.findall(r"draining", log)) == 1
    assert re.search(r"draining: 1 request\(s\) in flight", log)
