"""A long prompt scored for prompt logprobs shares the engine: a short request admitted
meanwhile finishes between its chunks; a long step that computes is busy, not stalled."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import threading
import time

import pytest

from cpud import LLM, SamplingParams
from cpud.engine.outputs import OutputAccumulator, accumulate
from cpud.frontend.compute_activity import ComputeActivity


@pytest.fixture(scope="module")
def llm(model_factory):
    return LLM(
        model_factory("qwen3"), dtype="float32", max_model_len=1024, max_num_batched_tokens=64
    )


def test_a_short_request_finishes_while_a_long_prompt_is_still_scored(llm):
    engine = llm.engine
    vocab = llm.config.model.vocab_size
    rng = random.Random(3)
    long_prompt = [rng.randrange(10, vocab) for _ in range(900)]
    engine.add_request("long", long_prompt, SamplingParams(max_tokens=1, prompt_logprobs=2))
    engine.step()
    engine.step()
    engine.add_request("short", [11, 12, 13, 14], SamplingParams(max_tokens=2, ignore_eos=True))
    finished: dict[str, int] = {}
    folds: dict[str, OutputAccumulator] = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        for out in engine.step():
            folds.setdefault(out.request_id, OutputAccumulator()).add(out)
            if out.finished:
                finished[out.request_id] = steps
    finals = {request_id: fold.result() for request_id, fold in folds.items()}
    # 900 tokens at 64 a step take 15 steps; the short request needs two of them
    assert finished["short"] <= 3, f"the short request took {finished['short']} steps"
    assert finished["long"] >= 12, finished
    assert (
        len(finals["long"].prompt_logprobs) == 900
        and len(finals["short"].outputs[0].token_ids) == 2
    )


def spin(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


def test_compute_activity_tells_a_computing_thread_from_a_blocked_one():
    stop = threading.Event()
    for target, busy in ((spin, True), (stop.wait, False)):
        stop.clear()
        thread = threading.Thread(target=target, args=(stop,) if busy else ())
        thread.start()
        try:
            activity = ComputeActivity(thread.ident)
            time.sleep(0.3)
            assert activity.busy() is busy
        finally:
            stop.set()
            thread.join()


class PausingExecutor:
    """The real executor, whose third step first computes (a large step on a slow machine) or
    sleeps (a hung rank) for `pause` seconds."""

    def __init__(self, inner, computes: bool, pause: float = 1.0):
        self.inner, self.computes, self.pause = inner, computes, pause
        self.steps = 0

    def execute(self, plan):
        self.steps += 1
        if self.steps == 3:
            deadline = time.monotonic() + self.pause
            if self.computes:
                while time.monotonic() < deadline:
                    sum(range(1000))
            else:
                time.sleep(self.pause)
        return self.inner.execute(plan)

    def shutdown(self) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("computes", [True, False])
def test_a_long_step_that_computes_is_progress_and_one_that_waits_is_a_stall(
    model_factory, computes
):
    from cpud.frontend.async_engine import AsyncEngine

    llm = LLM(model_factory("qwen3"), dtype="float32", max_model_len=256)
    llm.engine.executor = PausingExecutor(llm.engine.executor, computes)
    engine = AsyncEngine(llm.engine)

    async def run() -> float:
        admission = await engine.validate([11, 12, 13], SamplingParams(max_tokens=6))
        worst = 0.0
        outputs = engine.generate("r", admission).__aiter__()
        task = asyncio.ensure_future(collect(outputs))
        while not task.done():
            worst = max(worst, engine.seconds_without_progress())
            await asyncio.sleep(0.05)
        assert len(accumulate(await task).outputs[0].token_ids) == 6
        return worst

    try:
        worst = asyncio.run(run())
    finally:
        engine.shutdown()
    if computes:
        assert worst < 0.6, f"a computing step read as {worst:.2f} s without progress"
    else:
        assert worst > 0.7, f"a sleeping step read as only {worst:.2f} s without progress"


async def collect(outputs) -> list:
    return [out async for out in outputs]


@pytest.mark.parametrize("computes", [True, False])
def test_compute_activity_reads_the_rank_processes(computes):
    work = "while True: pass" if computes else "import time; time.sleep(60)"
    rank = subprocess.Popen([sys.executable, "-c", work])
    try:
        time.sleep(0.3)
        activity = ComputeActivity(threading.get_ident(), [rank.pid])
        time.sleep(0.5)
        assert activity.busy() is computes
    finally:
        rank.kill()
        rank.wait()
