"""Per-token cost flat with length: with a stub forward pass, the engine's work per step
outside the forward (scheduling, the plan and its encoding, outputs, and the stream consumer's
tool-call and logprob handling) is the same at 8000 output tokens as at 500."""

from __future__ import annotations

import statistics
import time

import pytest
from stub_engine import StubExecutor, stub_engine

from cpud import LLM, SamplingParams
from cpud.frontend.logprobs import chat_logprobs
from cpud.frontend.tool_calls import ToolCallStream

TEXT = "The weather in Paris is mild today, with a light wind from the west. "
EARLY, LATE, WINDOW = 500, 8000, 300


@pytest.fixture(scope="module")
def base(model_factory):
    llm = LLM(model_factory("qwen3"), dtype="float32", max_model_len=256)
    return llm.config, llm.tokenizer


def step_costs(
    base, seqs: int, logprobs: int | None, tools: bool, **params
) -> tuple[list[int], StubExecutor]:
    """Thread CPU time of each step outside the stub forward (the consumer included), and the
    stub's record."""
    config, tokenizer = base
    length = LATE + WINDOW
    engine, stub = stub_engine(config, tokenizer, TEXT, length + 64, seqs)
    params = SamplingParams(
        temperature=0, max_tokens=length, ignore_eos=True, logprobs=logprobs, **params
    )
    prompt = tokenizer.encode("Tell me about the weather")
    streams = {}
    for i in range(seqs):
        engine.add_request(str(i), prompt, params)
        streams[str(i)] = ToolCallStream("hermes") if tools else None
    costs = []
    texts = {key: [] for key in streams}
    while engine.has_unfinished():
        started = time.thread_time_ns()
        for out in engine.step():
            stream = streams[out.request_id]
            for choice in out.outputs:
                text = choice.text
                if stream is not None:
                    text, _ = stream.feed_delta(text, choice.finish_reason is not None)
                if logprobs is not None:
                    chat_logprobs(choice, 0, logprobs)
                texts[out.request_id].append(text)
        costs.append(time.thread_time_ns() - started - stub.forward_ns[-1])
    assert all(len("".join(parts)) >= length for parts in texts.values())
    return costs, stub


def window(costs: list[int], at: int) -> float:
    """Median cost of the steps around output token `at` (step k makes token k + 1)."""
    return statistics.median(costs[at - WINDOW // 2 : at + WINDOW // 2])


def assert_flat(costs: list[int]) -> None:
    early, late = window(costs, EARLY), window(costs, LATE)
    assert late <= 1.2 * early, f"a step costs {late / early:.2f}x at {LATE} tokens vs {EARLY}"


@pytest.mark.parametrize(
    ("logprobs", "tools"), [(None, False), (5, False), (None, True), (5, True)]
)
def test_one_stream_costs_the_same_per_step_at_8000_tokens_as_at_500(base, logprobs, tools):
    costs, _ = step_costs(base, 1, logprobs, tools)
    assert_flat(costs)


def test_one_stream_with_penalties_costs_the_same_per_step(base):
    costs, _ = step_costs(base, 1, None, False, repetition_penalty=1.1)
    assert_flat(costs)


@pytest.mark.slow
def test_a_batch_of_64_costs_the_same_per_step_at_8000_tokens_as_at_500(base):
    costs, _ = step_costs(base, 64, 5, True)
    assert_flat(costs)
