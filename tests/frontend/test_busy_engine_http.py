"""Heavy requests leave others served: a long logprobs request does not slow a bystander's
stream, and a short request finishes while a long prompt is still scored, /health 200."""

from __future__ import annotations

import statistics
import threading
import time

import httpx
import pytest

from cpud_server_helpers import metric, start_server, stream_times

PROMPT_LOGPROBS_LEN = 1000


@pytest.fixture(scope="module")
def server(model_factory, tmp_path_factory):
    srv = start_server(
        model_factory("qwen3"),
        tmp_path_factory.mktemp("busy") / "serve.log",
        "--max-model-len",
        "1024",
        "--max-num-batched-tokens",
        "8",
    )
    yield srv
    srv.stop()


def median_gap(times: list[float]) -> float:
    return statistics.median(b - a for a, b in zip(times, times[1:]))


class Background:
    """A request run on a thread; `done` says whether it has answered."""

    def __init__(self, base_url: str, body: dict):
        self.response: httpx.Response | None = None
        self.finished_at = 0.0

        def run() -> None:
            self.response = httpx.post(base_url + "/v1/completions", json=body, timeout=300)
            self.finished_at = time.monotonic()

        self.thread = threading.Thread(target=run)
        self.thread.start()

    @property
    def done(self) -> bool:
        return not self.thread.is_alive()

    def join(self) -> httpx.Response:
        self.thread.join(300)
        assert self.response is not None
        return self.response


class Companion:
    """A streamed request of the hostile one's shape without logprobs, until `stop`."""

    def __init__(self, base_url: str, body: dict):
        self.stopping = threading.Event()

        def run() -> None:
            url = base_url + "/v1/completions"
            with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as resp:
                for _ in resp.iter_lines():
                    if self.stopping.is_set():
                        return  # leaving the stream aborts the request

        self.thread = threading.Thread(target=run)
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(60)


def test_a_long_logprobs_request_leaves_a_bystander_stream_its_pace(server):
    """One bystander stream: first beside a request of the hostile one's shape without
    logprobs (what serving four more sequences costs it on this machine), then beside the
    hostile one. Phases next to each other in time, so the machine's other load weighs on
    both alike."""
    times: list[float] = []
    shape = {"model": "tiny", "prompt": "Write", "max_tokens": 800, "n": 4, "ignore_eos": True}
    bystander = threading.Thread(target=stream_times, args=(server.base_url, 700, times))

    def reach(count: int) -> None:
        while len(times) < count and bystander.is_alive():
            time.sleep(0.002)

    bystander.start()
    reach(60)
    companion = Companion(server.base_url, shape)
    reach(300)
    companion.stop()
    hostile = Background(server.base_url, {**shape, "logprobs": 20})
    bystander.join(120)
    assert not hostile.done, "the hostile request must outlast the bystander"
    response = hostile.join()
    assert response.status_code == 200
    assert [len(c["logprobs"]["tokens"]) for c in response.json()["choices"]] == [800] * 4
    assert len(times) > 500  # an event per step that made text
    idle, beside_plain = median_gap(times[10:60]), median_gap(times[100:300])
    beside_logprobs = median_gap(times[360:])
    # Logprobs cost a constant per token (the old output rebuilt every entry every step: the
    # gap grew with the hostile output, to 20x here); batching four more sequences already
    # moves a 1 ms gap of this tiny model more than the logprobs do.
    assert beside_logprobs <= 2 * beside_plain, (
        f"median gap {beside_logprobs * 1e3:.1f} ms beside the logprobs request, "
        f"{beside_plain * 1e3:.1f} ms beside the same without logprobs, {idle * 1e3:.1f} idle"
    )


def test_a_short_request_finishes_while_a_long_prompt_is_scored(server):
    prompt = [10 + (i * 7919) % 500 for i in range(PROMPT_LOGPROBS_LEN)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 5}
    sent = time.monotonic()
    scorer = Background(server.base_url, body)
    deadline = time.monotonic() + 30
    while metric(server, "cpud_requests_running") < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    health: list[int] = []
    asked = time.monotonic()
    short = httpx.post(
        server.base_url + "/v1/completions",
        json={"model": "tiny", "prompt": "Hi", "max_tokens": 2, "ignore_eos": True},
        timeout=120,
    )
    short_seconds = time.monotonic() - asked
    while not scorer.done:
        health.append(httpx.get(server.base_url + "/health", timeout=10).status_code)
        time.sleep(0.01)
    assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 2
    response = scorer.join()
    assert response.status_code == 200
    assert len(response.json()["choices"][0]["prompt_logprobs"]) == PROMPT_LOGPROBS_LEN
    # The prompt takes 125 steps of the 8-token budget; the short request needs 2 or 3 of them
    # (waiting for the rest of the prompt, it took most of the scorer's time).
    scorer_seconds = scorer.finished_at - sent
    assert short_seconds < 0.4 * scorer_seconds, (short_seconds, scorer_seconds)
    assert set(health) <= {200}
