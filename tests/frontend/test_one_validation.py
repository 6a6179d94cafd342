"""A request is checked once, by the engine's `validate`, and what the check found (the output
budget, the compiled grammar) is what the engine admits; a grammar compiles off the event loop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from cpud import LLM, SamplingParams
from cpud.engine.admission import Admission
from cpud.engine.outputs import accumulate
from cpud.frontend.async_engine import AsyncEngine
from cpud.frontend.errors import APIError
from cpud.frontend.openai_api import start_requests
from cpud.frontend.requests import Prompt
from cpud.frontend.state import ServerConfig, ServerState
from cpud.settings.errors import RequestError
from cpud.structured.spec import StructuredSpec

CHOICES = ("alpha", "beta", "gamma delta")


@pytest.fixture(scope="module")
def llm(model_factory):
    return LLM(model_factory("qwen3"), dtype="float32")


class Spy:
    """Counts the engine's validations and grammar compiles, and the threads they ran on."""

    def __init__(self, engine, monkeypatch):
        self.validated: list[Admission] = []
        self.compiled: list[threading.Thread] = []
        validate, start = engine.validate, engine.grammars.start

        def counted_validate(ids, params):
            admission = validate(ids, params)
            self.validated.append(admission)
            return admission

        def counted_start(spec):
            self.compiled.append(threading.current_thread())
            return start(spec)

        monkeypatch.setattr(engine, "validate", counted_validate)
        monkeypatch.setattr(engine.grammars, "start", counted_start)


def test_validation_works_out_the_budget_and_compiles_the_grammar(llm):
    limit = llm.config.max_model_len
    free = llm.engine.validate([1, 2, 3], SamplingParams(max_tokens=None))
    assert free.max_tokens == limit - 3 and free.grammar is None
    assert free.prompt_token_ids == (1, 2, 3)
    spec = StructuredSpec("choice", choices=CHOICES)
    constrained = llm.engine.validate([1, 2, 3], SamplingParams(max_tokens=5, structured=spec))
    assert constrained.max_tokens == 5 and constrained.grammar is not None
    with pytest.raises(RequestError, match="max_tokens 99999 is too large") as caught:
        llm.engine.validate([1, 2, 3], SamplingParams(max_tokens=99_999))
    assert caught.value.param == "max_tokens"


def test_the_offline_api_validates_each_request_once(llm, monkeypatch):
    spy = Spy(llm.engine, monkeypatch)
    params = SamplingParams(
        max_tokens=8, temperature=0, n=2, structured=StructuredSpec("choice", choices=CHOICES)
    )
    outputs = llm.generate([[1, 2, 3], "Pick:"], params)
    assert len(spy.validated) == 2 and len(spy.compiled) == 2  # not once more per choice
    for output in outputs:
        assert [o.text for o in output.outputs if o.text not in CHOICES] == []
    assert {a.max_tokens for a in spy.validated} == {8}


def test_the_server_validates_once_and_compiles_off_the_event_loop(llm, monkeypatch):
    spy = Spy(llm.engine, monkeypatch)
    state = ServerState(ServerConfig(("tiny",), llm.config.max_model_len), llm.tokenizer)
    spec = StructuredSpec("choice", choices=CHOICES)
    params = SamplingParams(max_tokens=8, temperature=0, structured=spec)
    prompts = [Prompt([1, 2, 3], None), Prompt([4, 5, 6], None)]

    async def main():
        state.attach(AsyncEngine(llm.engine))
        try:
            streams = await start_requests(state, "cmpl-1", prompts, params)
            finals = []
            for stream in streams:
                finals.append(accumulate([out async for out in stream]))
            too_long = Prompt([1] * llm.config.max_model_len, None)
            with pytest.raises(APIError) as refused:
                await start_requests(state, "cmpl-2", [*prompts, too_long], params)
            return threading.current_thread(), finals, refused.value
        finally:
            state.engine.shutdown()
            state.close()

    loop_thread, finals, refused = asyncio.run(main())
    assert len(spy.validated) == 2 + 2  # the refused batch: its first two, then the third fails
    assert len(spy.compiled) == 4 and loop_thread not in spy.compiled
    assert [f.outputs[0].text in CHOICES for f in finals] == [True, True]
    assert refused.status == 400 and refused.code == "context_length_exceeded"
    assert not llm.engine.has_unfinished()
