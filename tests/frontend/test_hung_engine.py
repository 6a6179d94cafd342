"""A step that hangs (rank 0 stopped at tp 2) until the supervisor counts the rank lost: every
request gets a proper error, not only the one inside the step. Requests that queued behind the
hung step, streamed or not, completions or chat, get 503 engine_dead with an OpenAI-shaped body,
or a stream's error event then [DONE] on a body that ends cleanly; the log has no traceback."""

from __future__ import annotations

import os
import re
import signal
import time

from request_outcomes import Requests

from cpud_server_helpers import metric, rank_pids, start_server

TP2 = ("--tp", "2", "--bind", "0|1", "--max-model-len", "256", "--rank-timeout", "8")
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
PROMPT = {"model": "tiny", "prompt": "hi", "max_tokens": 8}
LONG = {**PROMPT, "max_tokens": 240, "ignore_eos": True, "stream": True}


def test_every_request_behind_a_hung_step_gets_an_error(model_factory, tmp_path):
    srv = start_server(model_factory("qwen3"), tmp_path / "serve.log", *TP2)
    try:
        sent = Requests(srv.base_url)
        inside = sent.send("/v1/completions", LONG)
        deadline = time.monotonic() + 20
        while metric(srv, "cpud_requests_running") < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(rank_pids(srv.proc.pid)[0], signal.SIGSTOP)
        time.sleep(0.3)  # the step in progress is waiting for the stopped rank
        queued = [
            sent.send("/v1/completions", PROMPT),
            sent.send("/v1/chat/completions", CHAT),
            sent.send("/v1/completions", {**PROMPT, "stream": True}),
            sent.send("/v1/chat/completions", {**CHAT, "stream": True}),
            sent.send("/v1/completions", {**PROMPT, "prompt": ["a", "b"], "n": 2}),
        ]
        sent.wait(40)
        assert srv.proc.wait(30) == 3, srv.log()
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()
    for outcome in [inside, *queued]:
        assert outcome.complete, outcome.describe()
        error = outcome.error
        assert error is not None and error["code"] == "engine_dead", outcome.describe()
        if outcome.events:
            assert outcome.status == 200 and outcome.events[-1] == "[DONE]", outcome.describe()
        else:
            assert outcome.status == 503, outcome.describe()
            assert set(error) == {"message", "type", "param", "code"}
    # No process logs a traceback: the surviving rank names the abort its lost peer caused in
    # one line.
    records = re.split(r"\n(?=\d{4}-\d\d-\d\d )", srv.log())
    tracebacks = [r for r in records if "Traceback" in r]
    assert not tracebacks, tracebacks
    assert not [r for r in records if " asyncio " in r or "Error in ASGI" in r]
