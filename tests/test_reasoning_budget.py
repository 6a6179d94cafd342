"""Reasoning options: thinking_token_budget (vLLM) and thinking.budget_tokens (Anthropic) close
the reasoning once it has used its budget (the engine writes `</think>`, or harmony's `<|end|>`
and a final header, through the output-constraint mask), and stream_reasoning false (SGLang)
streams the reasoning in one piece. The scripted model writes its script, except where the
mask allows a single token: then it writes that one and goes on with its script after."""

from __future__ import annotations

from collections import deque

import pytest
import scripted_engine
from scripted_engine import (
    HARMONY_TEMPLATE,
    OPEN_THINK_TEMPLATE,
    THINK_TEMPLATE,
    ScriptedExecutor,
    reasoning_model,
    scripted_clients,
)
from test_reasoning_api import ASK, anthropic_client

from cpud.frontend.reasoning import ReasoningPlan
from cpud.frontend.reasoning_budget import one_token_mask, reasoning_budget
from cpud.protocol.step import SampledToken, SeqWork

THOUGHT = "<think>\nOne two three four five six seven eight nine ten"
ANALYSIS = "<|channel|>analysis<|message|>One two three four five six seven eight"


class MaskedScriptedExecutor(ScriptedExecutor):
    def write(self, work: SeqWork) -> SampledToken:
        allowed = int.from_bytes(work.allowed_mask, "little")
        if allowed == 0 or allowed & (allowed - 1):  # no mask, or more than one token
            return super().write(work)
        if work.seq_id not in self.writing:
            self.writing[work.seq_id] = deque(self.scripts.popleft())
        return SampledToken(work.seq_id, allowed.bit_length() - 1)


@pytest.fixture(scope="module")
def model(model_factory, tmp_path_factory):
    return reasoning_model(model_factory("qwen3"), tmp_path_factory.mktemp("budget") / "m")


def _clients(model, template):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(scripted_engine, "ScriptedExecutor", MaskedScriptedExecutor)
        with scripted_clients(model, template) as clients:
            yield clients


@pytest.fixture(scope="module")
def think(model):
    yield from _clients(model, THINK_TEMPLATE)


@pytest.fixture(scope="module")
def gpt_oss(model):
    yield from _clients(model, HARMONY_TEMPLATE)


def tokens(server, text: str) -> list[int]:
    return server.tokenizer.encode(text, add_special_tokens=False)


def text_of(server, ids: list[int]) -> str:
    return server.tokenizer.decode(ids, skip_special_tokens=False).strip()


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_token_budget_closes_the_think_block(think, stream):
    """Budget 6: `<think>` and four words, then `</think>`; the script's rest is the answer."""
    server, client, _ = think
    server.will_say(THOUGHT)
    ask = {"model": "scripted", "messages": ASK, "extra_body": {"thinking_token_budget": 6}}
    if stream:
        chunks = list(
            client.chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **ask
            )
        )
        deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
        reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
        content = "".join(d.get("content") or "" for d in deltas)
        usage = chunks[-1].usage
    else:
        answer = client.chat.completions.create(**ask)
        message = answer.choices[0].message.model_dump()
        reasoning, content, usage = message["reasoning_content"], message["content"], answer.usage
    said = tokens(server, THOUGHT)
    assert (reasoning, content) == (text_of(server, said[1:5]), text_of(server, said[5:]))
    assert usage.completion_tokens_details.reasoning_tokens == 6


def test_thinking_token_budget_ends_harmony_analysis(gpt_oss):
    server, client, _ = gpt_oss
    server.will_say(ANALYSIS)
    answer = client.chat.completions.create(
        model="scripted", messages=ASK, extra_body={"thinking_token_budget": 5}
    )
    message = answer.choices[0].message.model_dump()
    said = tokens(server, ANALYSIS)
    start = said.index(tokens(server, "<|message|>")[0]) + 1
    decode = server.tokenizer.decode  # harmony bodies are kept as written
    assert message["reasoning_content"] == decode(said[start : start + 3])
    assert message["content"] == decode(said[start + 3 :])
    assert answer.usage.completion_tokens_details.reasoning_tokens == 5


def test_anthropic_budget_tokens_caps_the_thinking_block(think):
    server, _, http = think
    server.will_say(THOUGHT)
    message = anthropic_client(http).messages.create(
        model="scripted",
        max_tokens=64,
        messages=ASK,
        thinking={"type": "enabled", "budget_tokens": 4},
    )
    said = tokens(server, THOUGHT)
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in message.content] == [
        ("thinking", text_of(server, said[1:3])),
        ("text", text_of(server, said[3:])),
    ]


def test_stream_reasoning_false_sends_the_reasoning_in_one_piece(think):
    server, client, _ = think
    server.will_say("<think>\nParis is in France, as ever.\n</think>\n\nSunny.")
    chunks = client.chat.completions.create(
        model="scripted", messages=ASK, stream=True, extra_body={"stream_reasoning": False}
    )
    deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
    pieces = [d["reasoning_content"] for d in deltas if d.get("reasoning_content")]
    assert pieces == ["Paris is in France, as ever."]
    assert "".join(d.get("content") or "" for d in deltas) == "Sunny."


def test_budget_constraint_proposals_stop_where_the_budget_is_spent(think):
    """Speculative proposals are kept up to the token that spends the budget; the position
    after it may only close the reasoning; checking them leaves the state as it was."""
    server = think[0]
    tok = server.tokenizer
    budget = reasoning_budget(
        ReasoningPlan("qwen3"),
        4,
        lambda text: tok.encode(text, add_special_tokens=False),
        lambda token: tok.decode([token], skip_special_tokens=False),
    )
    said = tokens(server, THOUGHT)
    constraint = budget.constraint()
    kept, masks = constraint.draft_masks(said)
    assert kept == said[:3] and masks == [b"", b"", b"", one_token_mask(budget.close[0])]
    for token in said[:3]:
        assert constraint.allowed_mask() == b""
        constraint.advance(token)
    assert constraint.allowed_mask() == one_token_mask(budget.close[0])
    assert constraint.draft_masks(said[3:]) == ([], [one_token_mask(budget.close[0])])


def test_a_real_model_writes_the_closing_token_at_the_budget(model):
    """The mask reaches the rank's sampler: the fixture model (prompt opening the think block)
    writes `</think>` as its 5th token under budget 5, then goes on with its answer."""
    from cpud.engine.executor import InProcessExecutor
    from cpud.settings.config import EngineArgs, resolve_config

    config = resolve_config(EngineArgs(model=model, dtype="float32", max_model_len=512), model)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(scripted_engine, "ScriptedExecutor", lambda _: InProcessExecutor(config))
        with scripted_clients(model, OPEN_THINK_TEMPLATE) as (_, client, _):
            answer = client.chat.completions.create(
                model="scripted",
                messages=ASK,
                max_tokens=10,
                temperature=0,
                logprobs=True,
                extra_body={"thinking_token_budget": 5, "ignore_eos": True},
            )
    tokens = [entry.token for entry in answer.choices[0].logprobs.content]
    assert tokens[4] == "</think>" and "</think>" not in tokens[:4]
    assert answer.usage.completion_tokens_details.reasoning_tokens == 5
    assert answer.usage.completion_tokens == 10 and answer.choices[0].message.content


def test_anthropic_thinking_disabled_closes_harmony_analysis_at_once(gpt_oss):
    server, _, http = gpt_oss
    server.will_say(ANALYSIS)
    message = anthropic_client(http).messages.create(
        model="scripted", max_tokens=64, messages=ASK, thinking={"type": "disabled"}
    )
    said = tokens(server, ANALYSIS)
    start = said.index(tokens(server, "<|message|>")[0]) + 1
    assert [(b.type, b.text) for b in message.content] == [
        ("text", server.tokenizer.decode(said[start:]))
    ]
