"""In process: a step that fails after hanging ends every request with EngineDeadError, those
queued behind it included; a draining engine refuses new requests and `fail_open` ends the
admitted ones; the frontend's Lifecycle answers waiting work at a refusal and handlers at a cut."""

from __future__ import annotations

import asyncio
import threading

import pytest

from cpud import LLM, SamplingParams
from cpud.engine.llm_engine import LLMEngine
from cpud.engine.rank_group import RankDiedError
from cpud.frontend.async_engine import AsyncEngine, EngineDeadError, StoppingError
from cpud.frontend.errors import APIError
from cpud.frontend.lifecycle import Lifecycle

PARAMS = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)


class HangingExecutor:
    """Each step waits for `release`; then the first fails as a lost rank does."""

    def __init__(self, inner, fail: bool):
        self.inner = inner
        self.fail = fail
        self.entered = threading.Event()
        self.release = threading.Event()

    def execute(self, plan):
        self.entered.set()
        self.release.wait(30)
        if self.fail:
            raise RankDiedError("rank 0 sent no heartbeat: stopped or wedged; killed")
        return self.inner.execute(plan)

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None


@pytest.fixture(scope="module")
def llm(model_factory):
    return LLM(model_factory("qwen3"), dtype="float32")


async def outcome(engine: AsyncEngine, request_id: str) -> object:
    try:
        admission = await engine.validate([1, 2, 3], PARAMS)
        async for out in engine.generate(request_id, admission):
            if out.finished:
                return out
    except Exception as exc:
        return exc
    return None


def test_requests_queued_behind_a_failing_step_all_get_engine_dead(llm):
    executor = HangingExecutor(llm.engine.executor, fail=True)
    engine = AsyncEngine(LLMEngine(llm.config, llm.tokenizer, executor))

    async def main():
        inside = asyncio.ensure_future(outcome(engine, "inside"))
        await asyncio.to_thread(executor.entered.wait, 30)
        queued = [asyncio.ensure_future(outcome(engine, f"queued-{i}")) for i in range(3)]
        await asyncio.sleep(0.2)  # they wait in the engine's command queue
        executor.release.set()
        return await asyncio.wait_for(asyncio.gather(inside, *queued), 10)

    try:
        results = asyncio.run(main())
    finally:
        executor.release.set()
        engine.shutdown()
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert "rank 0 sent no heartbeat" in str(results[-1])


def test_a_draining_engine_refuses_new_requests_and_fail_open_ends_admitted_ones(llm):
    executor = HangingExecutor(llm.engine.executor, fail=False)
    engine = AsyncEngine(LLMEngine(llm.config, llm.tokenizer, executor))

    async def main():
        admitted = asyncio.ensure_future(outcome(engine, "admitted"))
        await asyncio.to_thread(executor.entered.wait, 30)
        engine.stop_admitting(StoppingError("draining", "draining"))
        with pytest.raises(StoppingError):
            engine.check_admission()
        refused = await outcome(engine, "late")
        assert engine.num_unfinished == 1
        engine.fail_open(StoppingError("the drain timeout ended it", "drain_timeout"))
        return refused, await asyncio.wait_for(admitted, 10)

    try:
        refused, cut = asyncio.run(main())
    finally:
        executor.release.set()
        engine.shutdown()
    assert isinstance(refused, StoppingError) and refused.code == "draining"
    assert isinstance(cut, StoppingError) and cut.code == "drain_timeout"
    assert engine.num_unfinished == 0


def test_lifecycle_answers_waiting_work_at_a_refusal_and_handlers_at_a_cut():
    refusal = APIError(503, "draining", code="draining")
    cut = APIError(503, "drain timeout", code="drain_timeout")

    async def main():
        lifecycle = Lifecycle()
        gate = asyncio.Event()

        async def work() -> str:
            await gate.wait()
            return "done"

        tokenizing = asyncio.ensure_future(lifecycle.before_admission(work()))
        handler = asyncio.ensure_future(lifecycle.until_cut(work()))
        await asyncio.sleep(0.01)
        lifecycle.refuse(refusal)
        await asyncio.sleep(0.01)
        assert tokenizing.done() and tokenizing.exception() is refusal
        assert not handler.done()  # admitted work goes on through a refusal
        lifecycle.cut(cut)
        await asyncio.sleep(0.01)
        assert handler.done() and handler.exception() is cut
        with pytest.raises(APIError) as late:
            await lifecycle.before_admission(work())
        assert late.value is refusal
        gate.set()

    asyncio.run(main())
