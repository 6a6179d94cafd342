"""SIGTERM while requests are still being templated and tokenized, and while long ones run past
the drain timeout: the ones not yet admitted get a 503 "draining" with Retry-After, the ones cut
at the timeout get an error body (or a stream's error event then [DONE]), never an empty 500 or a
cut body, and the drain's log line counts what happened."""

from __future__ import annotations

import re
import signal
import socket
import time

from request_outcomes import Requests

from cpud_server_helpers import metric, start_server

# Rendering this template takes a while (2 million empty loop turns, within the render
# budget): requests queue for the two tokenizer threads.
SLOW_TEMPLATE = (
    "{% for i in range(1500) %}{% for j in range(1500) %}{% endfor %}{% endfor %}"
    "{{ messages[0]['content'] }}"
)
LONG = {"model": "tiny", "prompt": "go", "max_tokens": 1000, "n": 32, "ignore_eos": True}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_drain_refuses_what_it_has_not_admitted_and_cuts_with_an_error(model_factory, tmp_path):
    srv = start_server(
        model_factory("qwen3"),
        tmp_path / "serve.log",
        "--max-model-len",
        "1024",
        "--drain-timeout",
        "2",
        "--chat-template",
        SLOW_TEMPLATE,
    )
    try:
        sent = Requests(srv.base_url)
        cut_whole = sent.send("/v1/completions", LONG)
        cut_stream = sent.send("/v1/completions", {**LONG, "stream": True})
        deadline = time.monotonic() + 20
        while metric(srv, "cpud_requests_running") < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        # ~0.3 s of template each, two at a time: seconds of work queued for the tokenizer
        templated = [sent.send("/v1/chat/completions", CHAT) for _ in range(24)]
        time.sleep(0.7)
        srv.proc.send_signal(signal.SIGTERM)
        sent.wait(30)
        assert srv.proc.wait(30) == 0, srv.log()
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()
    for outcome in (cut_whole, cut_stream):
        assert outcome.complete and outcome.error is not None, outcome.describe()
        assert outcome.error["code"] == "drain_timeout", outcome.describe()
    assert cut_whole.status == 503 and set(cut_whole.error) == {"message", "type", "param", "code"}
    assert cut_stream.status == 200 and cut_stream.events[-1] == "[DONE]"
    refused = [o for o in templated if o.status == 503]
    assert refused, [o.describe() for o in templated]
    for outcome in templated:
        assert outcome.complete, outcome.describe()
        if outcome.status == 503:
            assert outcome.error["code"] == "draining" and outcome.retry_after, outcome.describe()
        else:
            assert outcome.status == 200, outcome.describe()
    log = srv.log()
    line = re.search(r"drained in [\d.]+ s: (\d+) request\(s\) finished, (\d+) cut.*", log)
    assert line is not None, log
    assert int(line.group(2)) == 2, line.group(0)
    assert f"{len(refused)} refused" in line.group(0), line.group(0)
    # Some were refused after waiting for the tokenizer: they had arrived before the drain began.
    waited = re.findall(r'"POST /v1/chat/completions" 503 ([\d.]+)s .*error=draining', log)
    assert max(map(float, waited)) > 0.05, waited
    assert "Traceback" not in log, log


def test_a_body_still_arriving_does_not_hold_the_drain(model_factory, tmp_path):
    srv = start_server(model_factory("qwen3"), tmp_path / "serve.log", "--max-model-len", "256")
    try:
        host, port = srv.base_url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=20) as conn:
            conn.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                b'{"prompt":'
            )
            time.sleep(0.5)  # the handler is reading the body
            started = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            received = b""
            while chunk := conn.recv(65536):  # the server closes the connection once answered
                received += chunk
            answer = received.decode()
            assert srv.proc.wait(20) == 0, srv.log()
        # well inside the 30 s drain timeout, which it would otherwise wait out
        assert time.monotonic() - started < 10
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()
    assert answer.startswith("HTTP/1.1 503"), answer
    assert '"code":"draining"' in answer.replace(" ", ""), answer
    assert "0 cut at the drain timeout, 1 refused" in srv.log(), srv.log()
