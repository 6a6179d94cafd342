"""Reasoning through the HTTP API with the openai client: the engine writes scripted outputs
(think blocks, harmony channels) through the real detokenizer; the answers carry
reasoning_content / reasoning, content and tool calls, streamed and whole alike."""

from __future__ import annotations

import json

import pytest
from scripted_engine import (
    HARMONY_TEMPLATE,
    OPEN_THINK_TEMPLATE,
    THINK_TEMPLATE,
    reasoning_model,
    scripted_clients,
)

WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model(model_factory, tmp_path_factory):
    return reasoning_model(model_factory("qwen3"), tmp_path_factory.mktemp("reasoning") / "m")


@pytest.fixture(scope="module")
def think(model):
    with scripted_clients(model, THINK_TEMPLATE) as clients:
        yield clients


@pytest.fixture(scope="module")
def gpt_oss(model):
    with scripted_clients(model, HARMONY_TEMPLATE) as clients:
        yield clients


def streamed(client, **kwargs) -> dict:
    """A streamed chat answer folded: reasoning, content, tool calls, finish reason."""
    out = {"reasoning": "", "content": "", "calls": {}, "finish": None, "both": True}
    for chunk in client.chat.completions.create(model="scripted", stream=True, **kwargs):
        choice = chunk.choices[0]
        delta = choice.delta.model_dump()
        out["reasoning"] += delta.get("reasoning_content") or ""
        out["both"] &= delta.get("reasoning_content") == delta.get("reasoning")
        out["content"] += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            entry = out["calls"].setdefault(call["index"], {"name": None, "arguments": ""})
            if call["function"].get("name"):
                assert call["id"] and entry["name"] is None
                entry["name"] = call["function"]["name"]
            entry["arguments"] += call["function"].get("arguments") or ""
        out["finish"] = choice.finish_reason or out["finish"]
    out["calls"] = [(c["name"], json.loads(c["arguments"])) for c in out["calls"].values()]
    return out


def whole(client, **kwargs) -> dict:
    answer = client.chat.completions.create(model="scripted", **kwargs)
    message = answer.choices[0].message.model_dump()
    assert message.get("reasoning") == message.get("reasoning_content")
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message.get("tool_calls") or []
    ]
    return {
        "reasoning": message.get("reasoning_content") or "",
        "content": message["content"] or "",
        "calls": calls,
        "finish": answer.choices[0].finish_reason,
        "both": True,
    }


ANSWERS = (whole, streamed)


@pytest.mark.parametrize("answer", ANSWERS)
def test_think_blocks_become_reasoning_content(think, answer):
    server, client, _ = think
    server.will_say("<think>\nParis is in France.\n</think>\n\nIt is sunny in Paris.")
    got = answer(client, messages=ASK)
    assert got == {
        "reasoning": "Paris is in France.",
        "content": "It is sunny in Paris.",
        "calls": [],
        "finish": "stop",
        "both": True,
    }


@pytest.mark.parametrize("answer", ANSWERS)
def test_think_then_a_hermes_tool_call(think, answer):
    server, client, _ = think
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    server.will_say(f"<think>\nI need the weather.\n</think>\n\n<tool_call>\n{call}\n</tool_call>")
    got = answer(client, messages=ASK, tools=WEATHER)
    assert got["reasoning"] == "I need the weather." and got["content"] == ""
    assert got["calls"] == [("get_weather", {"city": "Paris"})]
    assert got["finish"] == "tool_calls"


@pytest.mark.parametrize("answer", ANSWERS)
def test_a_reasoning_only_answer_cut_by_max_tokens(think, answer):
    server, client, _ = think
    server.will_say("<think>\nLet me think about the weather in Paris for a long while")
    got = answer(client, messages=ASK, max_tokens=6)
    assert got["finish"] == "length" and got["content"] == "" and got["reasoning"]
    assert "Let me think about the weather in Paris".startswith(got["reasoning"])


@pytest.mark.parametrize("answer", ANSWERS)
def test_enable_thinking_false_reads_no_reasoning(think, answer):
    server, client, _ = think
    server.will_say("<think>x</think>plain")
    got = answer(
        client, messages=ASK, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert (got["reasoning"], got["content"]) == ("", "<think>x</think>plain")


@pytest.mark.parametrize("answer", ANSWERS)
def test_a_prompt_that_opens_the_think_block(model, answer):
    with scripted_clients(model, OPEN_THINK_TEMPLATE) as (server, client, _):
        server.will_say("Weighing it.\n</think>\n\nYes.")
        got = answer(client, messages=ASK)
    assert (got["reasoning"], got["content"]) == ("Weighing it.", "Yes.")


def test_reasoning_parser_none_leaves_the_output_whole(model):
    with scripted_clients(model, THINK_TEMPLATE, reasoning_parser="none") as (server, client, _):
        server.will_say("<think>a</think>b")
        message = client.chat.completions.create(model="scripted", messages=ASK).choices[0]
    assert message.message.content == "<think>a</think>b"
    assert "reasoning_content" not in message.message.model_dump()


HARMONY_ANSWER = (
    "<|channel|>analysis<|message|>The user asks about Paris.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Sunny, 21 C.<|return|>"
)
HARMONY_CALL = (
    "<|channel|>analysis<|message|>Need the tool.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
)


@pytest.mark.parametrize("answer", ANSWERS)
def test_harmony_channels_split_reasoning_from_the_answer(gpt_oss, answer):
    server, client, _ = gpt_oss
    server.will_say(HARMONY_ANSWER)
    got = answer(client, messages=ASK)
    assert (got["reasoning"], got["content"], got["finish"]) == (
        "The user asks about Paris.",
        "Sunny, 21 C.",
        "stop",
    )


@pytest.mark.parametrize("answer", ANSWERS)
def test_harmony_tool_calls_are_openai_tool_calls(gpt_oss, answer):
    server, client, _ = gpt_oss
    server.will_say(HARMONY_CALL)
    got = answer(client, messages=ASK, tools=WEATHER)
    assert got["reasoning"] == "Need the tool." and got["content"] == ""
    assert got["calls"] == [("get_weather", {"city": "Paris"})]
    assert got["finish"] == "tool_calls"


@pytest.mark.parametrize("answer", ANSWERS)
@pytest.mark.parametrize(
    ("said", "reasoning", "content"),
    [
        ("Just words, no channels.", "", "Just words, no channels."),
        ("<|channel|>mystery<|message|>odd<|end|>", "", "odd"),
        ("<|channel|>analysis<|message|>hm<|end|>stray", "hm", "stray"),
        ("<|channel|>analysis never opened<|end|>", "", "<|channel|>analysis never opened<|end|>"),
    ],
)
def test_malformed_harmony_falls_back_to_content(gpt_oss, answer, said, reasoning, content):
    server, client, _ = gpt_oss
    server.will_say(said)
    got = answer(client, messages=ASK)
    assert (got["reasoning"], got["content"], got["finish"]) == (reasoning, content, "stop")


@pytest.mark.parametrize("answer", ANSWERS)
def test_harmony_reasoning_cut_by_max_tokens(gpt_oss, answer):
    server, client, _ = gpt_oss
    server.will_say(HARMONY_ANSWER)
    got = answer(client, messages=ASK, max_tokens=12)
    assert got["finish"] == "length" and got["content"] == ""
    assert "The user asks about Paris.".startswith(got["reasoning"]) and got["reasoning"]


def response_items(response) -> list[tuple]:
    items = []
    for item in response.output:
        if item.type == "reasoning":
            items.append(("reasoning", "".join(c.text for c in item.content or [])))
        elif item.type == "message":
            items.append(("message", "".join(c.text for c in item.content)))
        else:
            items.append(("function_call", item.name, json.loads(item.arguments)))
    return items


def streamed_response(client, **kwargs) -> tuple[list[tuple], list[str]]:
    """The final response's items, checked against the events that built them."""
    kinds, reasoning, final = [], {}, None
    with client.responses.stream(model="scripted", **kwargs) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.reasoning_text.delta":
                reasoning[event.item_id] = reasoning.get(event.item_id, "") + event.delta
        final = stream.get_final_response()
    items = response_items(final)
    streamed = [r for r in reasoning.values()]
    assert [i[1] for i in items if i[0] == "reasoning"] == streamed
    return items, kinds


def test_responses_carry_a_reasoning_item_before_the_message(gpt_oss):
    server, client, _ = gpt_oss
    server.will_say(HARMONY_ANSWER, HARMONY_ANSWER)
    expected = [("reasoning", "The user asks about Paris."), ("message", "Sunny, 21 C.")]
    assert response_items(client.responses.create(model="scripted", input="Weather?")) == expected
    items, kinds = streamed_response(client, input="Weather?")
    assert items == expected
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")


def test_responses_harmony_calls_are_function_call_items(gpt_oss):
    server, client, _ = gpt_oss
    server.will_say(HARMONY_CALL, HARMONY_CALL)
    tools = [{"type": "function", **WEATHER[0]["function"]}]
    expected = [
        ("reasoning", "Need the tool."),
        ("function_call", "get_weather", {"city": "Paris"}),
    ]
    whole_answer = client.responses.create(model="scripted", input="Weather?", tools=tools)
    assert response_items(whole_answer) == expected
    assert streamed_response(client, input="Weather?", tools=tools)[0] == expected


def test_responses_take_back_their_reasoning_items_as_input(think):
    """A client that sends the previous output back (reasoning item included) is answered."""
    server, client, _ = think
    server.will_say("<think>one</think>first", "<think>two</think>second")
    first = client.responses.create(model="scripted", input="Hi")
    assert response_items(first) == [("reasoning", "one"), ("message", "first")]
    history = [{"role": "user", "content": "Hi"}, *[i.model_dump() for i in first.output]]
    history.append({"role": "user", "content": "And?"})
    second = client.responses.create(model="scripted", input=history)
    assert response_items(second) == [("reasoning", "two"), ("message", "second")]


def test_a_reasoning_only_response_cut_by_max_output_tokens(think):
    server, client, _ = think
    server.will_say("<think>\nLet me think about the weather in Paris for a long while")
    response = client.responses.create(model="scripted", input="Weather?", max_output_tokens=6)
    assert response.status == "incomplete"
    [(kind, text)] = response_items(response)
    assert kind == "reasoning" and "Let me think about the weather".startswith(text)


def anthropic_client(http):
    from anthropic import Anthropic

    return Anthropic(base_url="http://testserver", api_key="unused", http_client=http)


def message_blocks(message) -> list[tuple]:
    blocks = []
    for block in message.content:
        if block.type == "thinking":
            blocks.append(("thinking", block.thinking))
        elif block.type == "text":
            blocks.append(("text", block.text))
        else:
            blocks.append(("tool_use", block.name, block.input))
    return blocks


THINKING_CASES = [
    ("think", "<think>\nHm.\n</think>\n\nSunny.", [("thinking", "Hm."), ("text", "Sunny.")]),
    (
        "gpt_oss",
        HARMONY_ANSWER,
        [("thinking", "The user asks about Paris."), ("text", "Sunny, 21 C.")],
    ),
    (
        "gpt_oss",
        HARMONY_CALL,
        [("thinking", "Need the tool."), ("tool_use", "get_weather", {"city": "Paris"})],
    ),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("clients", "said", "expected"), THINKING_CASES)
def test_messages_answer_thinking_blocks(request, clients, said, expected, stream):
    server, _, http = request.getfixturevalue(clients)
    server.will_say(said)
    client = anthropic_client(http)
    tools = [{"name": "get_weather", "input_schema": WEATHER[0]["function"]["parameters"]}]
    ask = {"model": "scripted", "max_tokens": 64, "messages": ASK, "tools": tools}
    if stream:
        with client.messages.stream(**ask) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**ask)
    stop = "tool_use" if expected[-1][0] == "tool_use" else "end_turn"
    assert message_blocks(message) == expected and message.stop_reason == stop


def test_messages_take_back_thinking_blocks_and_thinking_disabled_turns_it_off(think):
    server, _, http = think
    client = anthropic_client(http)
    server.will_say("<think>a</think>b", "<think>x</think>y")
    first = client.messages.create(
        model="scripted",
        max_tokens=64,
        messages=ASK,
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert message_blocks(first) == [("thinking", "a"), ("text", "b")]
    history = [*ASK, {"role": "assistant", "content": first.content}]
    history.append({"role": "user", "content": "And?"})
    second = client.messages.create(
        model="scripted", max_tokens=64, messages=history, thinking={"type": "disabled"}
    )
    assert message_blocks(second) == [("text", "<think>x</think>y")]


def test_include_reasoning_false_drops_it_and_separate_reasoning_false_keeps_it_in_content(think):
    server, client, _ = think
    said = "<think>\nHm.\n</think>\n\nSunny."
    server.will_say(said, said, said, said)
    for answer in ANSWERS:
        dropped = answer(client, messages=ASK, extra_body={"include_reasoning": False})
        assert (dropped["reasoning"], dropped["content"]) == ("", "Sunny.")
        kept = answer(client, messages=ASK, extra_body={"separate_reasoning": False})
        assert (kept["reasoning"], kept["content"]) == ("", said)


def rendered(http, model, path: str, body: dict) -> str:
    from cpud.text.tokenizer import Tokenizer

    answer = http.post(path, json={"model": "scripted", **body})
    assert answer.status_code == 200, answer.text
    return Tokenizer(model).decode(answer.json()["token_ids"], skip_special_tokens=False)


def test_reasoning_effort_and_earlier_reasoning_reach_the_template(model):
    template = (
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
        "{%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{%- endif %}"
        "{{ m.content }}<|im_end|>\n{%- endfor %}effort={{ reasoning_effort }}"
    )
    with scripted_clients(model, template) as (server, client, http):
        server.will_say("<think>one</think>first")
        first = client.chat.completions.create(model="scripted", messages=ASK)
        # the openai client sends the answer's message back as it came, reasoning included
        history = [*ASK, first.choices[0].message, {"role": "user", "content": "And?"}]
        history = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in history]
        chat = {"messages": history, "reasoning_effort": "high"}
        prompt = rendered(http, model, "/v1/chat/completions/render", chat)
        assert "<think>one</think>first" in prompt and prompt.endswith("effort=high")
        responses = {"input": "Hi", "reasoning": {"effort": "low"}}
        assert rendered(http, model, "/v1/responses/render", responses).endswith("effort=low")
        server.will_say("<think>r</think>a")
        answer = client.responses.create(model="scripted", **responses)
        assert answer.reasoning.effort == "low"


def test_harmony_calls_without_tools_to_call_are_left_out(gpt_oss):
    server, client, _ = gpt_oss
    server.will_say(HARMONY_CALL, HARMONY_CALL)
    for tool_choice in (None, "none"):
        tools = {"tools": WEATHER, "tool_choice": tool_choice} if tool_choice else {}
        got = whole(client, messages=ASK, **tools)
        assert (got["reasoning"], got["content"], got["calls"]) == ("Need the tool.", "", [])
        assert got["finish"] == "stop"


def _tokens(server, text: str) -> int:
    return len(server.tokenizer.encode(text, add_special_tokens=False))


def chat_usage(client, stream: bool, **kwargs):
    """The usage of a whole answer, or of a stream's last chunk (include_usage)."""
    if not stream:
        return client.chat.completions.create(model="scripted", **kwargs).usage
    options = {"include_usage": True}
    chunks = list(
        client.chat.completions.create(
            model="scripted", stream=True, stream_options=options, **kwargs
        )
    )
    return chunks[-1].usage


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fmt", ["think", "harmony"])
def test_usage_counts_the_reasoning_tokens(request, fmt, stream):
    """A think block's tokens, tags included; a harmony analysis message's from its
    <|message|> to its <|end|>; the answer's tokens are not reasoning."""
    server, client, _ = request.getfixturevalue("think" if fmt == "think" else "gpt_oss")
    if fmt == "think":
        reasoning = "<think>\nParis is in France.\n</think>"
        server.will_say(reasoning + "\n\nIt is sunny in Paris.")
    else:
        reasoning = "<|message|>The user asks about Paris.<|end|>"
        server.will_say(HARMONY_ANSWER)
    usage = chat_usage(client, stream, messages=ASK)
    assert usage.completion_tokens_details.reasoning_tokens == _tokens(server, reasoning)
    assert usage.completion_tokens > usage.completion_tokens_details.reasoning_tokens


def test_usage_without_a_reasoning_split_has_no_reasoning_count(think):
    server, client, _ = think
    server.will_say("<think>\nhidden\n</think>\n\nSunny.")
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    assert (
        chat_usage(client, False, messages=ASK, extra_body=kwargs).completion_tokens_details is None
    )


def test_responses_usage_counts_the_reasoning_tokens(gpt_oss):
    server, client, _ = gpt_oss
    server.will_say(HARMONY_ANSWER, HARMONY_ANSWER)
    want = _tokens(server, "<|message|>The user asks about Paris.<|end|>")
    whole = client.responses.create(model="scripted", input="Weather?").usage
    with client.responses.stream(model="scripted", input="Weather?") as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_response().usage
    assert whole.output_tokens_details.reasoning_tokens == want
    assert streamed.output_tokens_details.reasoning_tokens == want
