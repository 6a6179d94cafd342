"""Reasoning parsers as units: think blocks and harmony channels, fed whole, one character at a
time and in token-sized pieces (the split never depends on how the text arrives), cut by
max_tokens, malformed."""

from __future__ import annotations

import json

import pytest

from cpud.frontend.reasoning import (
    HARMONY,
    ReasoningPlan,
    detect_reasoning_parser,
    new_parser,
    plan_reasoning,
)
from cpud.frontend.reasoning_split import Split
from cpud.frontend.reasoning_stream import ChatTextStream, read_all


def pieces(text: str, how: str) -> list[str]:
    if how == "whole":
        return [text]
    if how == "chars":
        return list(text)
    # token-sized: markers whole, words apart
    out, word = [], ""
    for part in text.replace("<|", "\0<|").replace("|>", "|>\0").split("\0"):
        if part.startswith("<|"):
            out.append(part)
            continue
        for char in part:
            word += char
            if char in ' \n{}":,':
                out.append(word)
                word = ""
        if word:
            out.append(word)
            word = ""
    return out


def run(plan: ReasoningPlan, text: str, how: str, cut: bool = False) -> tuple[Split, bool]:
    parser = new_parser(plan)
    total = Split()
    for piece in pieces(text, how):
        total.extend(parser.feed(piece))
    total.extend(parser.finish(cut))
    return total, parser.called


def calls_of(split: Split) -> list[tuple[str, str]]:
    calls: dict[int, list[str]] = {}
    for delta in split.calls:
        if "id" in delta:
            assert delta["type"] == "function" and delta["id"].startswith("call_")
            calls[delta["index"]] = [delta["function"]["name"], ""]
        calls[delta["index"]][1] += delta["function"].get("arguments", "")
    return [(name, args) for name, args in calls.values()]


HOWS = ("whole", "chars", "tokens")
QWEN3 = ReasoningPlan("qwen3")
OPENED = ReasoningPlan("qwen3", opened=True)
GPT_OSS = ReasoningPlan(HARMONY)

THINK_CASES = [
    # (plan, text, cut, reasoning, content)
    (QWEN3, "<think>\nI add 2 and 2.\n</think>\n\nIt is 4.", False, "I add 2 and 2.", "It is 4."),
    (QWEN3, "  <think>a</think>b", False, "a", "b"),
    (OPENED, "\nweighing it\n</think>\n\nYes.", False, "weighing it", "Yes."),
    (QWEN3, "It is 4.", False, "", "It is 4."),
    # reasoning-only answers cut by max_tokens
    (QWEN3, "<think>\nfirst I", True, "first I", ""),
    (QWEN3, "<think>\nfirst I\n</thi", True, "first I", ""),
    (OPENED, "still thinking ", True, "still thinking", ""),
    # malformed: a block that does not open the answer, a near-miss marker, a lone close
    (QWEN3, "Sure <think>x</think> y", False, "", "Sure <think>x</think> y"),
    (QWEN3, "<thinking>x", False, "", "<thinking>x"),
    (QWEN3, "a</think>b", False, "", "a</think>b"),
    (QWEN3, "<thi", False, "", "<thi"),
    (ReasoningPlan("deepseek_r1", opened=True), "r</think>c", False, "r", "c"),
    # a model that writes the opening tag the prompt already wrote (DeepSeek-R1-0528)
    (ReasoningPlan("deepseek_r1", opened=True), "<think>\nr</think>c", False, "r", "c"),
    (OPENED, "<th", True, "", ""),
    (OPENED, "<th", False, "<th", ""),
]


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("case", THINK_CASES, ids=lambda c: repr(c[1])[:30])
def test_think_blocks(case, how):
    plan, text, cut, reasoning, content = case
    split, called = run(plan, text, how, cut)
    assert (split.reasoning, split.content, split.calls, called) == (reasoning, content, [], False)


def harmony(*messages: str) -> str:
    """Assistant messages as gpt-oss writes them after a prompt ending `<|start|>assistant`."""
    return "<|end|><|start|>assistant".join(messages)


ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather."
FINAL = "<|channel|>final<|message|>It is sunny."
CALL = (
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
)

HARMONY_CASES = [
    # (text, cut, reasoning, content, calls)
    (harmony(ANALYSIS, FINAL), False, "The user wants the weather.", "It is sunny.", []),
    (
        harmony(ANALYSIS, CALL),
        False,
        "The user wants the weather.",
        "",
        [("get_weather", '{"city": "Paris"}')],
    ),
    # the recipient in the role part of the header; a preamble on commentary is answer text
    (
        harmony(
            "<|channel|>commentary<|message|>Checking.",
            ' to=functions.lookup<|channel|>commentary json<|message|>{"q": 1}',
        ),
        False,
        "",
        "Checking.",
        [("lookup", '{"q": 1}')],
    ),
    # the recipient right after the prompt's `<|start|>assistant`
    (
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}',
        False,
        "",
        "",
        [("get_weather", '{"city": "Oslo"}')],
    ),
    # a reasoning-only answer cut by max_tokens, in the body and in the next header
    (ANALYSIS[:-5], True, "The user wants the wea", "", []),
    (harmony(ANALYSIS, "<|chan"), True, "The user wants the weather.", "", []),
    (ANALYSIS + "<|en", True, "The user wants the weather.", "", []),
    # a call cut by max_tokens: its arguments as far as they came
    (
        harmony(ANALYSIS, CALL[:-5]),
        True,
        "The user wants the weather.",
        "",
        [("get_weather", '{"city": "Pa')],
    ),
    # not harmony at all, an unknown channel, junk after a message, a header that never ends
    ("Plain words.", False, "", "Plain words.", []),
    ("<|channel|>mystery<|message|>odd text<|end|>", False, "", "odd text", []),
    (ANALYSIS + "<|end|>oops", False, "The user wants the weather.", "oops", []),
    (
        "<|channel|>analysis no message<|end|>x",
        False,
        "",
        "<|channel|>analysis no message<|end|>x",
        [],
    ),
    ("<|channel|>analysis<|message|>a<|message|>b", False, "a", "<|message|>b", []),
    ("<|channel|>final", False, "", "<|channel|>final", []),
]


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("case", HARMONY_CASES, ids=lambda c: repr(c[0])[:40])
def test_harmony_channels(case, how):
    text, cut, reasoning, content, calls = case
    split, called = run(GPT_OSS, text, how, cut)
    assert (split.reasoning, split.content, calls_of(split)) == (reasoning, content, calls)
    assert called == bool(calls)


def test_harmony_calls_stream_their_arguments_as_they_come():
    parser = new_parser(GPT_OSS)
    assert parser.feed(ANALYSIS + "<|end|><|start|>assistant").reasoning
    first = parser.feed("<|channel|>commentary to=functions.get_weather json<|message|>")
    assert [d["function"] for d in first.calls] == [{"name": "get_weather", "arguments": ""}]
    assert parser.feed('{"city"').calls == [{"index": 0, "function": {"arguments": '{"city"'}}]
    assert parser.feed(': "Oslo"}').calls[0]["function"]["arguments"] == ': "Oslo"}'
    assert parser.finish(False) == Split()


def test_harmony_with_parallel_tool_calls_off_reads_the_first_call_only():
    text = harmony(CALL, CALL.replace("get_weather", "other"))
    split, called = run(ReasoningPlan(HARMONY, max_calls=1), text, "tokens")
    assert calls_of(split) == [("get_weather", '{"city": "Paris"}')] and called


def test_a_prompt_that_opens_a_harmony_message_starts_in_its_body():
    prompt = "<|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>final<|message|>"
    plan = plan_reasoning(HARMONY, prompt)
    assert plan == ReasoningPlan(HARMONY, header="assistant<|channel|>final")
    assert run(plan, "Hello<|end|>", "chars")[0] == Split(content="Hello")
    analysis = prompt.replace("final", "analysis")
    assert run(plan_reasoning(HARMONY, analysis), "hmm", "whole")[0] == Split(reasoning="hmm")


def test_a_prompt_that_opens_a_harmony_call_streams_it_from_its_name():
    prompt = "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
    split, called = run(plan_reasoning(HARMONY, prompt), '{"city": "Rome"}<|call|>', "chars")
    assert calls_of(split) == [("get_weather", '{"city": "Rome"}')] and called


QWEN3_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- if enable_thinking is defined "
    "and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
)
HARMONY_TEMPLATE = "<|start|>{{ role }}<|channel|>final<|message|>{{ content }}<|end|>"


def test_the_parser_is_read_from_the_template():
    assert detect_reasoning_parser(QWEN3_TEMPLATE) == "qwen3"
    assert detect_reasoning_parser(HARMONY_TEMPLATE) == HARMONY
    assert detect_reasoning_parser("{{ messages }}") is None
    assert detect_reasoning_parser(None) is None


def test_the_plan_follows_the_prompt_and_the_template_kwargs():
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert plan_reasoning("qwen3", prompt) == QWEN3
    assert plan_reasoning("qwen3", prompt + "<think>\n") == OPENED
    assert plan_reasoning("qwen3", prompt + "<think>\n\n</think>\n\n") is None
    assert plan_reasoning("qwen3", prompt, {"enable_thinking": False}) is None
    assert plan_reasoning("qwen3", prompt, {"enable_thinking": True}) == QWEN3
    assert plan_reasoning("deepseek_r1", prompt).opened
    assert plan_reasoning("qwen3", prompt, constrained=True) is None
    assert plan_reasoning("none", prompt) is None and plan_reasoning(None, prompt) is None
    # harmony reasons whatever enable_thinking says
    assert plan_reasoning(HARMONY, "x", {"enable_thinking": False}) == GPT_OSS


def test_think_answers_are_read_for_hermes_tool_calls():
    call = '{"name": "f", "arguments": {"a": 1}}'
    text = f"<think>\nneed a call\n</think>\n\n<tool_call>\n{call}\n</tool_call>"
    stream = ChatTextStream(QWEN3, "hermes", None)
    total = Split()
    for piece in pieces(text, "chars"):
        total.extend(stream.feed(piece, False))
    total.extend(stream.feed("", True))
    assert total.reasoning == "need a call" and total.content == ""
    assert [(n, json.loads(a)) for n, a in calls_of(total)] == [("f", {"a": 1})]
    assert stream.called


def test_harmony_calls_are_not_read_by_a_tool_call_parser():
    stream = ChatTextStream(GPT_OSS, "hermes", None)
    news = stream.feed(harmony(ANALYSIS, CALL), True)
    assert stream.tools is None and calls_of(news) == [("get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize("case", HARMONY_CASES, ids=lambda c: repr(c[0])[:40])
def test_a_whole_output_reads_as_its_stream(case):
    text, cut, reasoning, content, calls = case
    read = read_all(GPT_OSS, text, cut)
    assert read.reasoning == (reasoning or None) and read.content == (content or None)
    assert [(c.name, c.arguments) for c in read.calls] == calls
    assert read_all(None, text, cut).content == text
