"""Two cpud servers (one core each) behind the real vllm-router on loopback: every request the
router forwards is served (it renders each one on a worker first: no 4xx anywhere), requests
sharing a long prefix stay on one worker under cache_aware, and under kv_aware the router
routes on the KV-cache events cpud publishes."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from cpud_server_helpers import Server, free_port, launch, wait_healthy

pytestmark = pytest.mark.slow
ROUTER = shutil.which("vllm-router")
if ROUTER is None:  # a test extra: its absence is an install error, not a reason to skip
    raise RuntimeError("vllm-router is not installed: pip install -e '.[test]'")

SYSTEM = "You are a careful assistant. " * 12  # a long shared prefix: several KV blocks


def router_command(port: int, workers: list[Server], *policy: str) -> list[str]:
    """The command line cpud's replicas run behind (see contracts: --router uses it)."""
    return [
        ROUTER,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--worker-urls",
        *[w.base_url for w in workers],
        "--health-check-interval-secs",
        "2",
        "--log-level",
        "debug",
        *policy,
    ]


class Router:
    def __init__(self, command: list[str], log_path: Path, port: int):
        self.log_path = log_path
        self.base_url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            command, stdout=log_path.open("w"), stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_ready(self, timeout: float = 60) -> Router:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"vllm-router did not come up:\n{self.log()}")

    def log(self) -> str:
        return re.sub(r"\x1b\[[0-9;]*m", "", self.log_path.read_text(errors="replace"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(15)


@pytest.fixture(scope="module")
def workers(model_factory, tmp_path_factory):
    """Two servers, one core each, each publishing its KV-cache events (with the replay
    socket: a router that starts after blocks were cached asks for the batches it missed)."""
    model = model_factory("qwen3")
    logs = tmp_path_factory.mktemp("workers")
    started, endpoints = [], []
    for core in (0, 1):
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        replay = f"tcp://127.0.0.1:{free_port()}"
        events = json.dumps(
            {"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay}
        )
        started.append(
            launch(
                model,
                logs / f"worker{core}.log",
                "--bind",
                str(core),
                "--max-model-len",
                "1024",
                "--kv-events-config",
                events,
            )
        )
        endpoints.append((endpoint, replay))
    try:
        yield [wait_healthy(s, timeout=120) for s in started], endpoints
    finally:
        for server in started:
            server.stop()


def worker_requests(server: Server, path: str) -> dict[str, float]:
    """cpud_requests_total of one endpoint by status."""
    found = {}
    for line in httpx.get(server.base_url + "/metrics").text.splitlines():
        match = re.match(
            rf'cpud_requests_total\{{endpoint="{re.escape(path)}",status="(\d+)"\}} (\S+)', line
        )
        if match:
            found[match.group(1)] = float(match.group(2))
    return found


def served(workers: list[Server], path: str) -> list[float]:
    return [worker_requests(w, path).get("200", 0.0) for w in workers]


def refused(workers: list[Server]) -> list[str]:
    """Every 4xx/5xx answer the workers gave (health and metrics aside)."""
    bad = []
    for server in workers:
        for line in httpx.get(server.base_url + "/metrics").text.splitlines():
            match = re.match(
                r'cpud_requests_total\{endpoint="([^"]+)",status="(\d+)"\} (\S+)', line
            )
            loading = match and match.group(1) == "/health"  # 503 until the ranks load
            if match and not loading and match.group(2)[0] in "45" and float(match.group(3)) > 0:
                bad.append(f"{server.base_url} {match.group(1)} {match.group(2)}")
    return bad


def conversation_turns(topic: str, turns: int) -> list[list[dict]]:
    """A multi-turn chat: each turn's messages extend the previous turn's."""
    messages = [{"role": "system", "content": SYSTEM}]
    out = []
    for turn in range(turns):
        messages = [*messages, {"role": "user", "content": f"{topic}: question {turn}"}]
        out.append(messages)
        messages = [*messages, {"role": "assistant", "content": f"answer {turn} on {topic}"}]
    return out


def test_requests_pass_through_cache_aware(workers, tmp_path):
    servers, _ = workers
    port = free_port()
    command = router_command(port, servers, "--policy", "cache_aware")
    router = Router(command, tmp_path / "router.log", port).wait_ready()
    try:
        client = httpx.Client(base_url=router.base_url, timeout=120)
        chat = {"model": "tiny", "max_tokens": 4, "temperature": 0}
        before = served(servers, "/v1/chat/completions")
        for messages in conversation_turns("tides", 4):
            answer = client.post("/v1/chat/completions", json={**chat, "messages": messages})
            assert answer.status_code == 200, answer.text
        after = served(servers, "/v1/chat/completions")
        # One conversation, one worker: its turns share the long prefix the tree matched.
        assert sorted(a - b for a, b in zip(after, before)) == [0, 4]
        streamed = client.post(
            "/v1/chat/completions",
            json={**chat, "messages": [{"role": "user", "content": "hi"}], "stream": True},
        )
        assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
        completion = client.post(
            "/v1/completions", json={"model": "tiny", "prompt": SYSTEM, "max_tokens": 3}
        )
        assert completion.status_code == 200, completion.text
        response = client.post(
            "/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 3}
        )
        assert response.status_code == 200, response.text
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
        # What the router reads from its workers beyond the OpenAI API.
        loads = client.get("/get_loads").json()["workers"]
        assert len(loads) == 2 and all(w["load"] >= 0 for w in loads)  # -1: unreadable
        assert client.get("/get_model_info").json()["served_model_names"] == ["tiny"]
        assert client.get("/get_server_info").json()["block_size"] == 16
        assert client.get("/health_generate").status_code == 200
        assert client.post("/flush_cache").status_code == 200
        assert refused(servers) == []
        # The router rendered each request on a worker before routing it.
        assert sum(served(servers, "/v1/chat/completions/render")) >= 5
    finally:
        router.stop()


def test_kv_aware_routes_on_cpud_kv_events(workers, tmp_path):
    servers, endpoints = workers
    port = free_port()
    policy = ["--policy", "kv_aware", "--kv-event-model", "tiny", "--kv-event-block-size", "16"]
    for worker, (endpoint, replay) in zip(servers, endpoints):
        policy += ["--kv-event-source", f"{worker.base_url}={endpoint}"]
        policy += ["--kv-event-replay-source", f"{worker.base_url}={replay}"]
    router = Router(router_command(port, servers, *policy), tmp_path / "router.log", port)
    router.wait_ready()
    try:
        client = httpx.Client(base_url=router.base_url, timeout=120)
        for topic in ("orbits", "glaciers"):
            chosen = []
            for messages in conversation_turns(topic, 3):
                before = served(servers, "/v1/chat/completions")
                body = {"model": "tiny", "messages": messages, "max_tokens": 2}
                answer = client.post("/v1/chat/completions", json=body)
                assert answer.status_code == 200, answer.text
                after = served(servers, "/v1/chat/completions")
                chosen += [i for i in range(2) if after[i] > before[i]]
                time.sleep(0.3)  # the turn's events reach the router before the next turn
            # Later turns go where the earlier ones left their blocks.
            assert len(chosen) == 3 and len(set(chosen)) == 1, chosen
        assert refused(servers) == []
        log = router.log()
        assert "decode batch" not in log, log[-3000:]
        # The router read cpud's events: its subscriber advanced past the first batch, and
        # its decisions credit the prefix tokens the events said a worker holds.
        assert re.search(r"kv_index live sequence advanced .*seq=[1-9]", log), log[-3000:]
        assert re.search(r"credited_prefix_tokens=[1-9]", log), log[-3000:]
    finally:
        router.stop()
