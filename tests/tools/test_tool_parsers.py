"""Tool calls read from model text (hermes, llama3_json, mistral), whole and as it streams,
and the grammars that force them, checked against llguidance with the default tokenizer."""

from __future__ import annotations

import json

import pytest

from cpud.frontend.errors import APIError
from cpud.frontend.schemas import ChatMessage, FunctionCall, ToolCall
from cpud.frontend.tool_calls import Parsed, ToolCallStream, detect_parser, parse
from cpud.frontend.tool_grammar import call_grammar
from cpud.frontend.tool_prompt import conversation, tool_dicts

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}

TEXTS = {
    "hermes": 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",'
    ' "note": {"x": "}{"}}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": '
    '{"a": 1, "b": 2}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "note": {"x": "}{"}}}'
    '; {"name": "add", "parameters": {"a": 1, "b": 2}}',
    "mistral": 'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris",'
    ' "note": {"x": "}{"}}}, {"name": "add", "arguments": {"a": 1, "b": 2}}]',
}
ARGS = [{"city": "Paris", "note": {"x": "}{"}}, {"a": 1, "b": 2}]


@pytest.mark.parametrize("parser", sorted(TEXTS))
def test_parse_finds_every_call_and_the_text_before(parser):
    parsed = parse(TEXTS[parser], parser)
    assert [c.name for c in parsed.calls] == ["get_weather", "add"]
    assert [json.loads(c.arguments) for c in parsed.calls] == ARGS
    assert parsed.content == (None if parser == "llama3_json" else "Let me check.")
    assert len(parse(TEXTS[parser], parser, parallel=False).calls) == 1


@pytest.mark.parametrize("parser", sorted(TEXTS))
def test_text_without_calls_is_content(parser):
    assert parse("Paris is sunny {today}.", parser).calls == []
    assert parse("Paris is sunny {today}.", parser).content == "Paris is sunny {today}."


def test_a_broken_call_leaves_the_text_as_content():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>'
    parsed = parse(text, "hermes")
    assert parsed.calls == [] and parsed.content == text


CUT = {
    "hermes": 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
    "mistral": 'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Pa',
}


@pytest.mark.parametrize("parser", sorted(CUT))
def test_a_call_cut_by_max_tokens_comes_as_far_as_it_came(parser):
    """As its stream sends it: the name, the arguments so far, no markup in the content."""
    text = CUT[parser]
    parsed = parse(text, parser, cut=True)
    assert parsed.content == "Let me check."
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", '{"city": "Pa')]
    stream = ToolCallStream(parser)
    content, deltas = stream.feed(text, True)
    assert content == "Let me check."
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Pa'
    before_name = text[: text.index('"get_weather"')]
    assert parse(before_name, parser, cut=True) == Parsed("Let me check.", [])
    assert parse(text, parser).content == text  # not cut: a broken call is text
    whole = TEXTS[parser]
    after_whole = whole[: whole.rindex('{"a"') + 4]  # the second call cut in its arguments
    assert [c.name for c in parse(after_whole, parser, cut=True).calls] == ["get_weather"]


def test_a_cut_bare_object_stays_content():
    """llama3_json: an object that is not yet a call may be an answer."""
    text = '{"city": "Pa'
    assert parse(text, "llama3_json", cut=True) == Parsed(text, [])


def test_a_bare_json_answer_streams_as_content():
    """llama3_json beside a JSON response_format: an object naming no function is the
    answer, sent as content when it ends."""
    text = '{"city": "Oslo", "sunny": true}'
    stream = ToolCallStream("llama3_json")
    assert stream.feed(text[:9], False) == ("", [])
    assert stream.feed(text, True) == (text, [])
    assert not stream.called


@pytest.mark.parametrize("parser", sorted(TEXTS))
@pytest.mark.parametrize("step", [1, 2, 7])
def test_streamed_deltas_rebuild_the_calls(parser, step):
    """As OpenAI streams them: id, type and name with empty arguments first, then argument
    fragments whose concatenation is the arguments' JSON."""
    text = TEXTS[parser]
    stream = ToolCallStream(parser)
    content, deltas = "", []
    for end in list(range(step, len(text), step)) + [len(text)]:
        new, found = stream.feed(text[:end], end == len(text))
        content += new
        deltas += found
    firsts = [d for d in deltas if "id" in d]
    assert [d["index"] for d in firsts] == [0, 1]
    assert all(d["type"] == "function" and d["id"].startswith("call_") for d in firsts)
    assert [d["function"] for d in firsts] == [
        {"name": "get_weather", "arguments": ""},
        {"name": "add", "arguments": ""},
    ]
    for index, expected in enumerate(ARGS):
        mine = [d for d in deltas if d["index"] == index]
        assert "id" in mine[0]  # the header comes before any fragment
        assert json.loads("".join(d["function"]["arguments"] for d in mine)) == expected
    assert content.strip() == ("" if parser == "llama3_json" else "Let me check.")


def test_stream_holds_a_possible_marker_and_caps_calls():
    stream = ToolCallStream("hermes", max_calls=1)
    assert stream.feed("Hi <tool", False) == ("Hi ", [])
    assert stream.feed("Hi <tooling>", False) == ("<tooling>", [])
    _, deltas = stream.feed("Hi <tooling>" + TEXTS["hermes"][len("Let me check.") :], True)
    assert {d["index"] for d in deltas} == {0}


def test_parser_detected_from_the_template():
    assert detect_parser("{{ '<tool_call>' }}") == "hermes"
    assert detect_parser("[TOOL_CALLS] {{ tools }}") == "mistral"
    assert detect_parser("<|python_tag|>{{ tools }}") == "llama3_json"
    assert detect_parser("{{ messages }}") == "hermes"
    assert detect_parser(None) == "hermes"


GOOD = {
    "hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
    "llama3_json": '{"name": "add", "parameters": {"a": 1, "b": 2}}',
    "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]',
}
BAD = {
    "hermes": '<tool_call>\n{"name": "sub", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
    "llama3_json": '{"name": "add", "parameters": {"a": "one", "b": 2}}',
    "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2, "c": 3}}]',
}


@pytest.mark.parametrize("parser", sorted(GOOD))
def test_call_grammar_takes_calls_and_refuses_the_rest(compiler, parser):
    tokenizer, grammars = compiler
    spec = call_grammar(tool_dicts_of([WEATHER, ADD]), parser, parallel=False)
    good = grammars.matcher(spec)
    assert good.consume_tokens(tokenizer.encode(GOOD[parser], add_special_tokens=False))
    assert good.is_accepting()
    bad = grammars.matcher(spec)
    ids = tokenizer.encode(BAD[parser], add_special_tokens=False)
    assert not (bad.consume_tokens(ids) and bad.is_accepting())


def test_parallel_grammar_takes_several_calls(compiler):
    tokenizer, grammars = compiler
    two = GOOD["hermes"] + "\n" + GOOD["hermes"]
    single = grammars.matcher(call_grammar(tool_dicts_of([ADD]), "hermes", parallel=False))
    assert not (single.consume_tokens(tokenizer.encode(two, add_special_tokens=False)))
    many = grammars.matcher(call_grammar(tool_dicts_of([ADD]), "hermes", parallel=True))
    assert many.consume_tokens(tokenizer.encode(two, add_special_tokens=False))
    assert many.is_accepting()


def tool_dicts_of(raw: list[dict]) -> list[dict]:
    import msgspec

    from cpud.frontend.schemas import Tool

    return tool_dicts([msgspec.convert(t, Tool) for t in raw])


def test_a_template_without_tools_gets_calls_and_results_as_hermes_text():
    call = ToolCall(id="call_1", function=FunctionCall(name="add", arguments='{"a": 1}'))
    messages = [
        ChatMessage(role="user", content="add"),
        ChatMessage(role="assistant", content=None, tool_calls=[call]),
        ChatMessage(role="tool", content="3", tool_call_id="call_1"),
    ]
    plain = conversation(messages, native_tools=False)
    written = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    assert plain[1]["content"] == written
    assert plain[2] == {"role": "tool", "content": "<tool_response>\n3\n</tool_response>"}
    native = conversation(messages, native_tools=True)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert native[2]["tool_call_id"] == "call_1"


def test_a_tool_result_needs_an_earlier_call():
    messages = [
        ChatMessage(role="user", content="add"),
        ChatMessage(role="tool", content="3", tool_call_id="call_9"),
    ]
    with pytest.raises(APIError, match="tool_call_id"):
        conversation(messages, native_tools=False)


def test_a_template_that_takes_tools_renders_them_and_the_calls():
    from cpud.text.chat_template import ChatTemplates

    template = (
        "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>"
        "{% endif %}{% for m in messages %}{{ m.role }}:"
        "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
        "{% endfor %}{{ m.content }}|{% endfor %}"
    )
    templates = ChatTemplates({"default": "{{ messages }}", "tool_use": template}, "test")
    assert templates.tool_template() == template
    assert detect_parser(templates.tool_template()) == "hermes"
    call = ToolCall(id="call_1", function=FunctionCall(name="add", arguments='{"a": 1}'))
    messages = conversation(
        [
            ChatMessage(role="user", content="add"),
            ChatMessage(role="assistant", tool_calls=[call]),
            ChatMessage(role="tool", content="3", tool_call_id="call_1"),
        ],
        native_tools=True,
    )
    text = templates.render(messages, False, {}, {"tools": tool_dicts_of([ADD])})
    assert text == (
        '<tools>add;</tools>user:add|assistant:<tool_call>{"name": "add", "arguments": '
        '{"a": 1}}</tool_call>|tool:3|'
    )
