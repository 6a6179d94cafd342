"""Anthropic's own clients, unmodified, against /v1/messages on the default model: the
anthropic SDK (create, stream, a tool round trip, count_tokens) and LangChain's
ChatAnthropic (text, bound tools, streaming)."""

from __future__ import annotations

import jsonschema
import pytest

WEATHER = {
    "name": "get_weather",
    "description": "The current weather of a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# The SDK's create() has no sampling arguments: they go as extra body fields.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def claude(smol):
    import anthropic

    return anthropic.Anthropic(base_url=smol.base_url, api_key="unused", max_retries=0)


def test_create_answers_a_message(claude):
    message = claude.messages.create(
        model="tiny",
        max_tokens=16,
        system="You answer briefly.",
        messages=[{"role": "user", "content": "Say hello."}],
        extra_body=GREEDY,
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 0 and 0 < message.usage.output_tokens <= 16


def test_stream_builds_the_same_message(claude):
    args = {
        "model": "tiny",
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "Name three colours."}],
        "extra_body": GREEDY,
    }
    # Cached prompt blocks and a fresh prefill may round a near tie apart: both cached here.
    claude.messages.create(**{**args, "max_tokens": 1})
    with claude.messages.stream(**args) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    whole = claude.messages.create(**args)
    assert text and final.content[0].text == text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_tool_use_then_tool_result_then_the_answer(claude):
    first = claude.messages.create(
        model="tiny",
        max_tokens=60,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    )
    assert first.stop_reason == "tool_use"
    [call] = [block for block in first.content if block.type == "tool_use"]
    assert call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 24 C"}
    second = claude.messages.create(
        model="tiny",
        max_tokens=40,
        messages=[
            *ASK,
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": [result]},
        ],
        tools=[WEATHER],
        extra_body=GREEDY,
    )
    assert second.content[0].type == "text" and second.content[0].text
    assert second.stop_reason in ("end_turn", "max_tokens")


def test_a_streamed_tool_use_arrives_parsed(claude):
    with claude.messages.stream(
        model="tiny",
        max_tokens=60,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    calls = [block for block in final.content if block.type == "tool_use"]
    assert calls and all(c.name == "get_weather" for c in calls)
    for call in calls:
        jsonschema.validate(call.input, WEATHER["input_schema"])


def test_count_tokens_matches_the_prompt_of_a_message(claude):
    args = {"model": "tiny", "system": "Be brief.", "messages": ASK, "tools": [WEATHER]}
    counted = claude.messages.count_tokens(**args)
    usage = claude.messages.create(max_tokens=1, **args).usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens > 0


def test_langchain_chat_anthropic_text_tools_and_stream(smol):
    from langchain_anthropic import ChatAnthropic
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        return "Sunny"

    llm = ChatAnthropic(
        model="tiny",
        base_url=smol.base_url,
        api_key="unused",
        max_tokens=24,
        temperature=0,
        max_retries=0,
    )
    llm.invoke("Say hello.", max_tokens=1)  # the prompt cached, as for the two that follow
    reply = llm.invoke("Say hello.")
    assert isinstance(reply.content, str) and reply.content
    assert reply.usage_metadata["output_tokens"] > 0
    streamed = "".join(chunk.text for chunk in llm.stream("Say hello."))
    assert streamed == reply.content
    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    called = bound.invoke("What is the weather in Paris?")
    [call] = called.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
