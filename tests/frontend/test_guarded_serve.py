"""`cpud serve` against an operator's careless settings: a chat template that cannot render a
sample conversation within its render budget stops the daemon at start (exit 2, naming the
template and the budget); one whose cost grows with the conversation passes that probe, and a
conversation that drives it past its budget gets a 400 naming the template while a bystander
is served and SIGTERM stays prompt. The same daemon runs with
--no-enable-prompt-tokens-details: usage then leaves out what the prefix cache served."""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time
import uuid

import httpx
import pytest
from gguf_writer import write_gguf

from cpud.settings.errors import ConfigError
from cpud.text.tokenizer import check_tokenizer
from cpud_server_helpers import launch, wait_healthy

NESTED_RANGES = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
# Cubic in each message's length: microseconds for a greeting, hours for 1000 characters.
CUBIC = (
    "{% for m in messages %}{% for a in m.content %}{% for b in m.content %}"
    "{% for c in m.content %}{% endfor %}{% endfor %}{% endfor %}"
    "<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_a_template_that_cannot_render_in_budget_stops_the_daemon(model_factory, tmp_path):
    started = time.monotonic()
    model = model_factory("qwen3")
    server = launch(model, tmp_path / "serve.log", "--chat-template", NESTED_RANGES)
    assert server.proc.wait(timeout=120) == 2, server.log()
    elapsed = time.monotonic() - started
    log = server.log()
    assert "--chat-template cannot render a 4-message sample conversation within its budget" in log
    assert "1 s of CPU" in log and "Traceback" not in log
    assert elapsed < 30, elapsed  # the probe, not a hang (about 3 s on an idle machine)


def test_a_gguf_template_that_cannot_render_in_budget_is_refused(model_factory, tmp_path):
    source = model_factory("qwen3")
    model = tmp_path / "hostile"
    shutil.copytree(source, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": "{{ 'a'*10**8 * 100 }}"})
    )
    path = write_gguf(model, tmp_path / "hostile.gguf")
    with pytest.raises(ConfigError, match="^tokenizer.chat_template of hostile.gguf cannot render"):
        check_tokenizer(path)


@pytest.fixture(scope="module")
def guarded(model_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("guarded")
    template = root / "cubic.jinja"
    template.write_text(CUBIC)
    server = launch(
        model_factory("qwen3"),
        root / "serve.log",
        "--max-model-len",
        "512",
        "--chat-template",
        str(template),
        "--no-enable-prompt-tokens-details",
    )
    wait_healthy(server)
    yield server
    server.stop(timeout=60)


def chat(server, content: str, timeout: float = 120) -> httpx.Response:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 2,
        "temperature": 0,
    }
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=timeout)


def test_a_conversation_past_the_budget_is_a_400_and_a_bystander_is_served(guarded):
    replies: dict[str, httpx.Response] = {}
    took: dict[str, float] = {}

    def send(name: str, content: str) -> None:
        start = time.monotonic()
        replies[name] = chat(guarded, content)
        took[name] = time.monotonic() - start

    hostile = threading.Thread(target=send, args=("hostile", "x" * 1000))
    hostile.start()
    time.sleep(0.2)
    send("bystander", "hi")
    hostile.join(120)
    assert replies["bystander"].status_code == 200, replies["bystander"].text
    error = replies["hostile"].json()["error"]
    assert replies["hostile"].status_code == 400
    assert error["code"] == "chat_template_budget" and error["param"] == "messages"
    assert error["message"].startswith("the chat template (--chat-template) went past its render")
    assert took["hostile"] < 30 and took["bystander"] < 30, took
    assert httpx.get(guarded.base_url + "/health", timeout=10).status_code == 200
    assert "went past its render budget" in guarded.log()


def test_usage_leaves_out_the_cached_tokens(guarded):
    prompt = f"{uuid.uuid4().hex} " + " ".join(f"w{i}" for i in range(40))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
    for _ in range(2):  # the second is served from the prefix cache
        reply = httpx.post(guarded.base_url + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        usage = reply.json()["usage"]
        assert usage["prompt_tokens"] > 32 and "prompt_tokens_details" not in usage
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream(
        "POST", guarded.base_url + "/v1/completions", json=stream, timeout=120
    ) as reply:
        events = [line[6:] for line in reply.iter_lines() if line.startswith("data: {")]
    usages = [json.loads(e)["usage"] for e in events if json.loads(e).get("usage")]
    assert usages and all("prompt_tokens_details" not in u for u in usages), events
    # short: the cubic template renders 80 characters in well under its budget
    short = f"{uuid.uuid4().hex[:12]} " + " ".join(f"w{i}" for i in range(20))
    text = {"model": "tiny", "input": short, "max_output_tokens": 1}
    for _ in range(2):
        reply = httpx.post(guarded.base_url + "/v1/responses", json=text, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["input_tokens_details"] == {"cached_tokens": 0}


def test_sigterm_stays_prompt_while_a_template_runs(guarded):
    hostile = threading.Thread(target=chat, args=(guarded, "x" * 1000, 60), daemon=True)
    hostile.start()
    time.sleep(0.3)
    started = time.monotonic()
    assert guarded.stop(signal.SIGTERM, timeout=60) == 0, guarded.log()[-3000:]
    assert time.monotonic() - started < 20
