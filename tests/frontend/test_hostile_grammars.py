"""Hostile output constraints over HTTP: refused with 400 at admission, compiled away from
the engine (a bystander's stream keeps its pace meanwhile), and not compiled at all when
their client has left."""

from __future__ import annotations

import statistics
import threading
import time

import httpx
import pytest

from cpud_server_helpers import start_server, stream_times


@pytest.fixture(scope="module")
def server(model_factory, tmp_path_factory):
    srv = start_server(
        model_factory("qwen3"),
        tmp_path_factory.mktemp("grammars") / "serve.log",
        "--max-model-len",
        "1024",
    )
    yield srv
    srv.stop()


def labelled(server, name: str, label: str) -> float:
    """The sample `name{label}` ("" for one without labels) of /metrics."""
    key = f"{name}{{{label}}} " if label else f"{name} "
    for line in httpx.get(server.base_url + "/metrics").text.splitlines():
        if line.startswith(key):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name}{{{label}}}")


def optional_properties(count: int, tag: str) -> dict:
    return {"type": "object", "properties": {f"{tag}{i}": {"type": "string"} for i in range(count)}}


def post(server, body: dict, timeout: float = 120) -> httpx.Response:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 4, **body}
    return httpx.post(server.base_url + "/v1/completions", json=body, timeout=timeout)


def test_input_caused_grammar_failures_are_400s_at_admission(server):
    cases = [
        ({"guided_regex": "a{1000}{1000}{9}"}, "guided_regex", "first token"),
        ({"guided_json": optional_properties(10_000, "big")}, "guided_json", "too big"),
        ({"guided_json": {"$ref": "#"}}, "guided_json", "allows no output"),
    ]
    for body, param, words in cases:
        response = post(server, body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and words in error["message"], error


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def test_hostile_grammars_leave_a_bystander_stream_its_pace(server):
    times: list[float] = []
    idle_tokens = 80
    bystander = threading.Thread(target=stream_times, args=(server.base_url, 1000, times))
    bystander.start()
    while len(times) < idle_tokens and bystander.is_alive():
        time.sleep(0.005)
    bodies = [{"guided_regex": "a{1000}{1000}{" + str(n) + "}"} for n in range(20, 26)]
    bodies += [{"guided_json": optional_properties(3000, f"s{i}_")} for i in range(3)]
    statuses: list[int] = []
    hostile = [
        threading.Thread(target=lambda b=body: statuses.append(post(server, b).status_code))
        for body in bodies
    ]
    started = time.monotonic()
    for thread in hostile:
        thread.start()
    for thread in hostile:
        thread.join(120)
    ended = time.monotonic()
    bystander.join(120)
    idle = statistics.median(gaps(times[10:idle_tokens]))
    loaded_times = [t for t in times if started <= t <= ended]
    assert len(loaded_times) > 20, "the bystander must stream while the grammars compile"
    loaded = statistics.median(gaps(loaded_times))
    print(f"bystander median gap {idle * 1e3:.2f} ms idle, {loaded * 1e3:.2f} ms loaded")
    assert sorted(statuses)[:6] == [400] * 6 and set(statuses) <= {200, 400, 429}, statuses
    assert loaded <= 1.5 * idle, f"median gap {loaded * 1e3:.1f} ms vs {idle * 1e3:.1f} ms idle"


def test_a_client_that_leaves_does_not_get_its_grammar_compiled(server):
    def compiles() -> float:
        return labelled(server, "cpud_grammar_compile_seconds_count", "")

    def cancelled() -> float:
        return labelled(server, "cpud_grammar_rejected_total", 'reason="cancelled"')

    compiled_before, cancelled_before = compiles(), cancelled()
    sent = 6
    for index in range(sent):  # slow to compile: a few seconds each
        try:
            post(server, {"guided_json": optional_properties(5000, f"left{index}_")}, 0.3)
        except httpx.TimeoutException:
            pass  # the client gives up and closes the connection
    deadline, last, stable_since = time.monotonic() + 90, -1.0, time.monotonic()
    while time.monotonic() < deadline:  # until the compiles that did start have finished
        now = compiles()
        if now != last:
            last, stable_since = now, time.monotonic()
        elif time.monotonic() - stable_since > 3 and cancelled() > cancelled_before:
            break
        time.sleep(0.2)
    assert cancelled() - cancelled_before >= 1
    assert compiles() - compiled_before < sent, "every abandoned grammar was compiled anyway"
