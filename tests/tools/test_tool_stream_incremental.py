"""The streaming tool-call reader reads each chunk's new text only (work in proportion to the
text, not to the text times the chunks), and its deltas rebuild the calls for any chunking."""

from __future__ import annotations

import json
import random

import pytest

from cpud.frontend.tool_calls import ToolCallStream, parse


class CountingText(str):
    """A str that counts the characters its Python-level reads return or search over."""

    work = 0

    def __getitem__(self, key):
        part = str.__getitem__(self, key)
        CountingText.work += len(part)
        return part

    def find(self, sub, start=None, end=None):
        at = str.find(self, sub, start, end)
        first = 0 if start is None else start
        last = (len(self) if end is None else end) if at == -1 else at + len(sub)
        CountingText.work += max(0, last - first)
        return at


def wrap(parser: str, calls: list[dict], lead: str = "Sure.") -> str:
    def body(call: dict) -> str:
        key = "parameters" if parser == "llama3_json" else "arguments"
        return json.dumps({"name": call["name"], key: call["arguments"]})

    if parser == "hermes":
        return lead + "".join(f"<tool_call>\n{body(c)}\n</tool_call>\n" for c in calls)
    if parser == "mistral":
        return lead + "[TOOL_CALLS][" + ", ".join(body(c) for c in calls) + "]"
    return "; ".join(body(c) for c in calls)


def streamed(parser: str, text: str, cuts: list[int], make=str) -> tuple[str, list[dict]]:
    stream = ToolCallStream(parser)
    content, deltas = "", []
    for end in cuts:
        new, found = stream.feed(make(text[:end]), end == len(text))
        content += new
        deltas += found
    return content, deltas


def rebuilt(deltas: list[dict]) -> list[tuple[str, str]]:
    calls: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    for delta in deltas:
        if "id" in delta:
            assert delta["index"] not in names, "one header per call"
            names[delta["index"]] = delta["function"]["name"]
        assert delta["index"] in names, "the header comes before the arguments"
        calls.setdefault(delta["index"], []).append(delta["function"].get("arguments", ""))
    return [(names[i], "".join(calls[i])) for i in sorted(calls)]


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_a_chunk_costs_its_own_length_not_the_output_so_far(parser):
    calls = [{"name": f"f{i}", "arguments": {"i": i, "s": "x}{" * 3}} for i in range(150)]
    text = wrap(parser, calls)
    cuts = list(range(4, len(text), 4)) + [len(text)]
    CountingText.work = 0
    _, deltas = streamed(parser, text, cuts, CountingText)
    assert len(rebuilt(deltas)) == 150
    # Each character is read a bounded number of times, plus a few characters per chunk (a
    # marker that may be arriving); rescanning from the start reads the text len(cuts) / 2
    # times over.
    bound = 4 * len(text) + 16 * len(cuts)
    assert CountingText.work <= bound, (CountingText.work, bound)


ODD = ["}{", '"quoted"', "back\\slash", "</tool", "[TOOL_CALLS", "ü €", "\\u0041", "a\nb"]


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(6 if depth < 3 else 3)
    if kind == 0:
        return rng.choice(ODD) + str(rng.randrange(100))
    if kind == 1:
        return rng.randrange(-5, 1000)
    if kind == 2:
        return rng.choice([True, None, 1.5])
    if kind == 3:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {f"k{i}": random_value(rng, depth + 1) for i in range(rng.randrange(3))}


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize("seed", range(6))
def test_streamed_deltas_equal_the_parsed_calls_for_any_chunking(parser, seed):
    rng = random.Random(seed)
    calls = [
        {"name": f"tool_{rng.randrange(99)}", "arguments": random_value(rng, 1) or {"a": 1}}
        for _ in range(rng.randrange(1, 5))
    ]
    for call in calls:
        if not isinstance(call["arguments"], dict):
            call["arguments"] = {"value": call["arguments"]}
    text = wrap(parser, calls)
    cuts = sorted({rng.randrange(1, len(text)) for _ in range(len(text) // 3)} | {len(text)})
    content, deltas = streamed(parser, text, cuts)
    whole = parse(text, parser)
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [
        (c["name"], c["arguments"]) for c in calls
    ]
    assert [(n, json.loads(a)) for n, a in rebuilt(deltas)] == [
        (c["name"], c["arguments"]) for c in calls
    ]
    assert content.strip() == (whole.content or "")


def test_arguments_before_the_name_wait_for_the_whole_call():
    text = '<tool_call>{"arguments": {"a": 1}, "name": "late"}</tool_call>'
    _, deltas = streamed("hermes", text, list(range(1, len(text) + 1)))
    assert rebuilt(deltas) == [("late", '{"a": 1}')]
    assert len(deltas) == 1 and deltas[0]["function"] == {"name": "late", "arguments": '{"a": 1}'}


def test_a_call_cut_by_its_closing_tag_ends_empty_and_the_next_one_streams():
    text = (
        '<tool_call>{"name": "cut", "arguments": {"a": </tool_call>'
        '<tool_call>{"name": "ok", "arguments": {"b": 2}}</tool_call>'
    )
    _, deltas = streamed("hermes", text, list(range(3, len(text), 3)) + [len(text)])
    assert rebuilt(deltas) == [("cut", '{"a": '), ("ok", '{"b": 2}')]
    assert [c.name for c in parse(text, "hermes").calls] == ["ok"]
