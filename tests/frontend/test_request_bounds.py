"""Issue 20, defect 1: a number out of range is a 400 naming the parameter before it reaches
the engine, and a failure that belongs to one request fails that request only."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpud import LLM, SamplingParams
from cpud.engine import llm_engine
from cpud.engine.outputs import OutputAccumulator
from cpud.protocol.control import encoder, to_rank_decoder
from cpud.settings.errors import RequestError

OK_PROMPT = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
CHAT_MESSAGES = [{"role": "user", "content": "hi"}]
BIG = 2**64


def post(server, path: str, body: dict | str) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {"content-type": "application/json"}
    return httpx.post(server.base_url + path, content=content, headers=headers, timeout=60)


def assert_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error


def assert_still_serving(server) -> None:
    ok = post(server, "/v1/completions", OK_PROMPT)
    assert ok.status_code == 200, ok.text
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200


# ---- the reproductions and every numeric field, against a real server ---------------


def test_top_k_above_uint64_on_completions_is_400(server):
    response = post(server, "/v1/completions", '{"prompt":"hi","top_k":18446744073709551616}')
    assert_error(response, 400, "top_k")
    assert_still_serving(server)


def test_stop_token_id_above_uint64_on_chat_is_400(server):
    # min_tokens puts the id into the step plan's banned list, which the ranks must decode
    body = {"messages": CHAT_MESSAGES, "max_tokens": 2, "min_tokens": 1, "stop_token_ids": [BIG]}
    assert_error(post(server, "/v1/chat/completions", body), 400, "stop_token_ids")
    assert_still_serving(server)


COMPLETION_CASES = [
    ("top_k", str(-BIG)),
    ("top_k", str(2**31)),
    ("seed", str(2**70)),
    ("seed", str(2**63)),
    ("seed", str(-(2**63) - 1)),
    ("n", str(BIG)),
    ("max_tokens", str(BIG)),
    ("min_tokens", str(BIG)),
    ("min_tokens", "-1"),
    ("logprobs", str(BIG)),
    ("stop_token_ids", f"[{2**31}]"),
    ("stop_token_ids", "[-1]"),
    ("stop_token_ids", json.dumps([1] * 1025)),
    ("stop", json.dumps(["x" * 4097])),
    ("prompt", f"[1, {BIG}]"),
    ("prompt", f"[[1, {BIG}]]"),
    ("temperature", "1e400"),
    ("top_p", "-1e400"),
    ("presence_penalty", "1e308"),
    ("repetition_penalty", str(10**400)),
    ("top_k", "9" * 5000),
]
CHAT_CASES = [
    ("max_completion_tokens", str(BIG)),
    ("top_logprobs", str(BIG)),
    ("seed", str(BIG)),
    ("min_p", "1e400"),
    ("frequency_penalty", "-1e400"),
]


@pytest.mark.parametrize("field,value", COMPLETION_CASES, ids=[c[0] for c in COMPLETION_CASES])
def test_out_of_range_completion_field_is_400_naming_it(server, field, value):
    base = {k: v for k, v in OK_PROMPT.items() if k != field}
    text = json.dumps(base)[:-1] + f', "{field}": {value}}}'
    assert_error(post(server, "/v1/completions", text), 400, field)


@pytest.mark.parametrize("field,value", CHAT_CASES, ids=[c[0] for c in CHAT_CASES])
def test_out_of_range_chat_field_is_400_naming_it(server, field, value):
    base = {"messages": CHAT_MESSAGES, "max_tokens": 2, "logprobs": True}
    text = json.dumps(base)[:-1] + f', "{field}": {value}}}'
    assert_error(post(server, "/v1/chat/completions", text), 400, field)


def test_detokenize_token_above_uint64_is_400(server):
    assert_error(post(server, "/detokenize", f'{{"tokens": [{BIG}]}}'), 400, "tokens")
    assert_still_serving(server)


# ---- property: no number in any field yields a 5xx or stops a parallel stream ---------------

EDGE_INTS = [0, 1, -1, 16, 17, 20, 21, 256, 2**31 - 1, 2**31, 2**63 - 1, 2**63, BIG - 1, BIG]
EDGE_INTS += [2**70, -(2**63), -(2**63) - 1, -BIG, 10**40]
NUMBERS = st.one_of(
    st.sampled_from(EDGE_INTS).map(str),
    st.integers(2**63 - 2, 2**66).map(str),
    st.integers(-(2**80), 2**80).map(str),
    st.floats().map(json.dumps),  # non-finite ones become NaN / Infinity, which JSON refuses
    st.sampled_from(["1e400", "-1e400", "1e-400", "-0.0", "0.5", "2.0", str(10**400)]),
)
# (field, where the number goes in its value)
SAMPLING = [
    (name, "{}")
    for name in ("n", "top_k", "seed", "min_tokens", "temperature", "top_p", "min_p")
    + ("presence_penalty", "frequency_penalty", "repetition_penalty", "max_tokens")
] + [("stop_token_ids", "[{}]")]
FIELDS = {
    "/v1/completions": [*SAMPLING, ("logprobs", "{}"), ("prompt", "[1, {}]"), ("prompt", "[[{}]]")],
    "/v1/chat/completions": [*SAMPLING, ("max_completion_tokens", "{}"), ("top_logprobs", "{}")],
    "/detokenize": [("tokens", "[{}]")],
}
BASES = {
    # min_tokens puts stop_token_ids on the wire to the ranks
    "/v1/completions": {"model": "tiny", "prompt": "hi", "max_tokens": 4, "min_tokens": 1},
    "/v1/chat/completions": {
        "model": "tiny",
        "messages": CHAT_MESSAGES,
        "max_tokens": 4,
        "min_tokens": 1,
    },
    "/detokenize": {"tokens": [1]},
}


@st.composite
def extreme_requests(draw: st.DrawFn) -> tuple[str, str, bool]:
    path = draw(st.sampled_from(sorted(FIELDS)))
    fields = draw(
        st.lists(st.sampled_from(FIELDS[path]), min_size=1, max_size=2, unique_by=lambda f: f[0])
    )
    body = dict(BASES[path])
    stream = path != "/detokenize" and draw(st.booleans())
    if stream:
        body["stream"] = True
    if any(name == "top_logprobs" for name, _ in fields):
        body["logprobs"] = True
    extra = []
    for name, template in fields:
        body.pop(name, None)
        extra.append(f'"{name}": {template.format(draw(NUMBERS))}')
    return path, json.dumps(body)[:-1] + ", " + ", ".join(extra) + "}", stream


class BackgroundStream:
    """A normal streaming client, in a loop, for as long as the block runs."""

    def __init__(self, server):
        self.server = server
        self.completed = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {**OK_PROMPT, "max_tokens": 24, "ignore_eos": True, "stream": True}
        while not self._stop.is_set():
            try:
                with httpx.stream(
                    "POST", self.server.base_url + "/v1/completions", json=body, timeout=60
                ) as response:
                    text = "".join(response.iter_text())
                if response.status_code != 200 or '"error"' in text or "[DONE]" not in text:
                    self.failures.append(f"{response.status_code}: {text[-300:]}")
                else:
                    self.completed += 1
            except httpx.HTTPError as exc:
                self.failures.append(repr(exc))
                time.sleep(0.5)

    def __enter__(self) -> BackgroundStream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


def test_extreme_numbers_never_give_5xx_nor_stop_other_streams(server):
    with BackgroundStream(server) as background:

        @settings(
            max_examples=200,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow],
        )
        @given(extreme_requests())
        def check(case: tuple[str, str, bool]) -> None:
            path, text, stream = case
            response = post(server, path, text)
            assert response.status_code < 500, (text[:300], response.text[:500])
            if response.status_code >= 400:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}
            elif stream:
                assert '"error"' not in response.text, (text[:300], response.text[-500:])
                assert "data: [DONE]" in response.text
            health = httpx.get(server.base_url + "/health", timeout=10)
            assert health.status_code == 200, (text[:300], health.text)

        check()
    assert not background.failures, background.failures[:3]
    assert background.completed >= 1
    assert_still_serving(server)


def unbounded_numbers(node: object, path: str = "$") -> list[str]:
    """JSON-schema paths of integers and numbers that lack a minimum or a maximum."""
    found = []
    if isinstance(node, dict):
        if node.get("type") in ("integer", "number"):
            has_min = "minimum" in node or "exclusiveMinimum" in node
            has_max = "maximum" in node or "exclusiveMaximum" in node
            if not (has_min and has_max):
                found.append(path)
        for key, value in node.items():
            found += unbounded_numbers(value, f"{path}.{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += unbounded_numbers(value, f"{path}[{index}]")
    return found


def test_every_request_number_is_bounded_in_the_schema():
    from cpud.frontend.openapi import openapi_document

    schemas = openapi_document()["components"]["schemas"]
    requests = {k: v for k, v in schemas.items() if k != "Error"}
    assert unbounded_numbers(requests) == []


# ---- the offline API refuses what the engine cannot represent -------------------------------

PARAM_CASES = [
    ("top_k", BIG),
    ("top_k", -2),
    ("seed", 2**63),
    ("seed", -(2**63) - 1),
    ("n", BIG),
    ("max_tokens", BIG),
    ("min_tokens", BIG),
    ("logprobs", BIG),
    ("stop_token_ids", (BIG,)),
    ("stop_token_ids", (-1,)),
    ("stop_token_ids", tuple(range(1025))),
    ("stop", ("x" * 4097,)),
    ("temperature", 10**400),
    ("temperature", float("nan")),
    ("top_p", float("inf")),
    ("top_k", 2.5),
    ("n", True),
]


@pytest.mark.parametrize("param,value", PARAM_CASES, ids=[f"{p}" for p, _ in PARAM_CASES])
def test_sampling_params_refuse_what_the_engine_cannot_hold(param, value):
    with pytest.raises(RequestError) as caught:
        SamplingParams(**{param: value})
    assert caught.value.param == param
    assert len(str(caught.value)) < 200 and "\n" not in str(caught.value)


# ---- engine isolation: one request's failure ends that request only -------------------------


class WireExecutor:
    """The in-process executor behind the rank wire format, as `cpud serve` sends plans."""

    def __init__(self, inner, gate: threading.Event | None = None):
        self.inner = inner
        self.gate = gate

    def execute(self, plan):
        if self.gate is not None:
            self.gate.wait(30)
        return self.inner.execute(to_rank_decoder.decode(encoder.encode(plan)))

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None


@pytest.fixture(scope="module")
def llm(model_factory):
    return LLM(model_factory("qwen3"), dtype="float32")


def new_engine(llm, gate: threading.Event | None = None) -> llm_engine.LLMEngine:
    return llm_engine.LLMEngine(llm.config, llm.tokenizer, WireExecutor(llm.engine.executor, gate))


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, **kwargs)


def run_async(llm, jobs: dict[str, SamplingParams], engine=None) -> dict[str, object]:
    """Each request's final output, or the exception that ended it, through an AsyncEngine."""
    from cpud.frontend.async_engine import AsyncEngine

    async def one(async_engine, request_id, params):
        fold = OutputAccumulator()
        admission = await async_engine.validate([1, 2, 3], params)
        async for out in async_engine.generate(request_id, admission):
            fold.add(out)
        return fold.result()

    async def main():
        async_engine = AsyncEngine(engine or new_engine(llm))
        try:
            tasks = [one(async_engine, rid, p) for rid, p in jobs.items()]
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
            assert async_engine.alive, async_engine.error
            return dict(zip(jobs, results))
        finally:
            async_engine.shutdown()

    return asyncio.run(main())


def test_plan_encode_failure_fails_only_its_request(llm):
    engine = new_engine(llm)
    engine.isolate_requests = True
    bad = greedy()
    engine.add_request("bad", [1, 2, 3], bad)
    engine.add_request("good", [1, 2, 3], greedy())
    object.__setattr__(bad, "top_k", BIG)  # past validation, as a bug could let it
    folds: dict[str, OutputAccumulator] = {}
    for _ in range(20):
        for o in engine.step():
            folds.setdefault(o.request_id, OutputAccumulator()).add(o)
        if not engine.has_unfinished():
            break
    finals = {rid: fold.result() for rid, fold in folds.items() if fold.finished}
    failures = engine.take_failures()
    assert [rid for rid, _ in failures] == ["bad"]
    assert isinstance(failures[0][1], llm_engine.RequestFailedError)
    assert set(finals) == {"good"} and len(finals["good"].outputs[0].token_ids) == 4
    assert engine.blocks.usage() == 0.0


def test_request_the_ranks_cannot_take_is_refused_at_add(llm):
    bad = greedy()
    object.__setattr__(bad, "top_k", BIG)
    results = run_async(llm, {"bad": bad, "good": greedy()})
    assert isinstance(results["bad"], RequestError), results["bad"]
    assert len(results["good"].outputs[0].token_ids) == 4


def test_postprocess_failure_fails_only_its_request(llm, monkeypatch):
    from cpud.engine.detokenizer import IncrementalDetokenizer

    add = IncrementalDetokenizer.add

    def exploding(self, token_id, check_stop=True):
        if "BOOM" in self.stop:
            raise KeyError("injected")
        return add(self, token_id, check_stop)

    monkeypatch.setattr(IncrementalDetokenizer, "add", exploding)
    results = run_async(llm, {"bad": greedy(stop=("BOOM",)), "good": greedy()})
    assert isinstance(results["bad"], llm_engine.RequestFailedError), results["bad"]
    assert "KeyError" in str(results["bad"])
    assert len(results["good"].outputs[0].token_ids) == 4


def test_offline_generate_raises_request_error_and_goes_on(llm):
    bad = greedy()
    object.__setattr__(bad, "top_k", BIG)
    with pytest.raises(RequestError):
        llm.generate([[1, 2, 3]], bad)
    assert not llm.engine.has_unfinished()
    assert len(llm.generate([[1, 2, 3]], greedy())[0].outputs[0].token_ids) == 4


def test_seconds_without_progress(llm):
    from cpud.frontend.async_engine import AsyncEngine

    gate = threading.Event()
    async_engine = AsyncEngine(new_engine(llm, gate))

    async def main():
        assert async_engine.seconds_without_progress() == 0.0
        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.6)
        stalled = async_engine.seconds_without_progress()
        gate.set()
        await asyncio.wait_for(task, 60)
        await asyncio.sleep(0.2)
        return stalled

    async def consume():
        admission = await async_engine.validate([1, 2, 3], greedy())
        async for _ in async_engine.generate("r", admission):
            pass

    try:
        stalled = asyncio.run(main())
        assert stalled >= 0.4
        assert async_engine.seconds_without_progress() == 0.0
    finally:
        gate.set()
        async_engine.shutdown()
