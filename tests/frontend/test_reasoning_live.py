"""Live `cpud serve` runs. The qwen3 fixture with --reasoning-parser qwen3 and a template that
opens the think block in the prompt (as Qwen3-Thinking's does): the model's greedy output is
reasoning until it writes `</think>`, whole and streamed alike, and the same output with
separate_reasoning false is the raw text the split was made from. The gpt-oss fixture (its
harmony template detected): the greedy answer is what the harmony parser reads in the raw
output, special tokens included, whatever the random weights write."""

from __future__ import annotations

import pytest
from scripted_engine import OPEN_THINK_TEMPLATE

from cpud.frontend.reasoning import HARMONY, ReasoningPlan
from cpud.frontend.reasoning_stream import read_all
from cpud_server_helpers import start_server

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Why is the sky blue?"}]
GREEDY = {"model": "qwen3", "messages": ASK, "temperature": 0, "max_tokens": 24}


@pytest.fixture(scope="module")
def client(model_factory, tmp_path_factory):
    from openai import OpenAI

    folder = tmp_path_factory.mktemp("reasoning-live")
    template = folder / "think.jinja"
    template.write_text(OPEN_THINK_TEMPLATE)
    server = start_server(
        model_factory("qwen3"),
        folder / "serve.log",
        "--served-model-name",
        "qwen3",
        "--max-model-len",
        "256",
        "--chat-template",
        str(template),
        "--reasoning-parser",
        "qwen3",
    )
    yield OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    server.stop()


def split_of(raw: str) -> tuple[str, str]:
    """(reasoning, content) of an output that began inside the think block."""
    reasoning, _, content = raw.partition("</think>")
    return reasoning.strip(), content.lstrip()


def test_the_greedy_output_splits_as_its_raw_text_does(client):
    raw = client.chat.completions.create(**GREEDY, extra_body={"separate_reasoning": False})
    text = raw.choices[0].message.content
    assert text and raw.choices[0].finish_reason == "length"
    message = client.chat.completions.create(**GREEDY).choices[0].message.model_dump()
    reasoning, content = split_of(text)
    assert reasoning  # noise writes no </think> this soon: the whole output is reasoning
    assert (message["reasoning_content"] or "", message["content"] or "") == (reasoning, content)
    streamed_reasoning, streamed_content = "", ""
    for chunk in client.chat.completions.create(**GREEDY, stream=True):
        delta = chunk.choices[0].delta.model_dump()
        streamed_reasoning += delta.get("reasoning_content") or ""
        streamed_content += delta.get("content") or ""
    assert (streamed_reasoning, streamed_content) == (reasoning, content)


def test_enable_thinking_false_reads_the_output_as_the_answer(client):
    body = {**GREEDY, "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    message = client.chat.completions.create(**body).choices[0].message.model_dump()
    assert message["content"] and message.get("reasoning_content") is None


@pytest.fixture(scope="module")
def gpt_oss(model_factory, tmp_path_factory):
    from openai import OpenAI

    folder = tmp_path_factory.mktemp("harmony-live")
    server = start_server(
        model_factory("gpt_oss"),
        folder / "serve.log",
        "--served-model-name",
        "gpt-oss",
        "--max-model-len",
        "512",
    )
    yield OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    server.stop()


def test_the_gpt_oss_answer_is_the_harmony_reading_of_its_raw_output(gpt_oss):
    """Random weights write no harmony: this checks the plumbing (template detection, the
    special tokens kept for the parser) and the plain fallback on a real output."""
    greedy = {**GREEDY, "model": "gpt-oss"}
    raw_body = {"separate_reasoning": False, "skip_special_tokens": False}
    raw = gpt_oss.chat.completions.create(**greedy, extra_body=raw_body).choices[0]
    cut = raw.finish_reason == "length"
    expected = read_all(ReasoningPlan(HARMONY, max_calls=0), raw.message.content, cut)
    message = gpt_oss.chat.completions.create(**greedy).choices[0].message.model_dump()
    assert message["content"] == expected.content
    assert message["reasoning_content"] == expected.reasoning
    assert not message.get("tool_calls")
