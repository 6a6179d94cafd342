"""The tool-call grammar as Pydantic-made tools need it and as the answer it stands beside:
each function's `$defs` resolve, whitespace is fixed as in response_format JSON, and with
tool_choice auto a response_format answer and a call are both sentences. Checked against
llguidance with the default tokenizer."""

from __future__ import annotations

import json
from enum import Enum

import msgspec
import openai
import pytest
from pydantic import BaseModel
from tool_models import Place, Unit

from cpud.frontend.schemas import Tool
from cpud.frontend.tool_grammar import call_grammar
from cpud.frontend.tool_prompt import tool_dicts
from cpud.structured.spec import StructuredSpec


class Forecast(BaseModel):
    """The weather forecast of a place."""

    place: Place
    unit: Unit
    days: int


class Scale(str, Enum):  # a second `Unit` in another tool's $defs: names must not collide
    metric = "metric"
    imperial = "imperial"


class Distance(BaseModel):
    """The distance between two cities."""

    origin: str
    destination: str
    unit: Scale


def pydantic_tools() -> list[dict]:
    forecast = openai.pydantic_function_tool(Forecast)
    distance = openai.pydantic_function_tool(Distance)
    # Both tools name their enum "Unit", as two unrelated Pydantic modules may.
    text = json.dumps(distance).replace('"Scale"', '"Unit"').replace("/Scale", "/Unit")
    tools = [forecast, json.loads(text)]
    assert all("$defs" in t["function"]["parameters"] for t in tools)
    return tool_dicts([msgspec.convert(t, Tool) for t in tools])


def accepts(compiler, spec: StructuredSpec, text: str) -> bool:
    tokenizer, grammars = compiler
    matcher = grammars.matcher(spec)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return bool(matcher.consume_tokens(ids)) and matcher.is_accepting()


FORECAST = (
    '{"name": "Forecast", "arguments": {"place": {"city": "Oslo", "country": "Norway"}, '
    '"unit": "celsius", "days": 2}}'
)
DISTANCE = (
    '{"name": "Distance", "arguments": {"origin": "Oslo", "destination": "Bergen", '
    '"unit": "metric"}}'
)


def written(call: str, parser: str) -> str:
    """A call as the parser's format writes it."""
    if parser == "hermes":
        return f"<tool_call>\n{call}\n</tool_call>"
    if parser == "mistral":
        return f"[TOOL_CALLS][{call}]"
    return call.replace('"arguments"', '"parameters"')


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_a_forced_call_resolves_each_tools_own_defs(compiler, parser):
    spec = call_grammar(pydantic_tools(), parser, parallel=True)
    between = "\n" if parser == "hermes" else "; "
    assert accepts(compiler, spec, written(FORECAST, parser))
    assert accepts(compiler, spec, written(DISTANCE, parser) + between + written(FORECAST, parser))
    # Each $ref resolves within its own tool: Forecast's Unit is not Distance's.
    for wrong in (
        FORECAST.replace("celsius", "metric"),
        DISTANCE.replace("metric", "celsius"),
        FORECAST.replace('"days": 2', '"days": "2"'),
    ):
        assert not accepts(compiler, spec, written(wrong, parser)), wrong


SPACED = {
    "no space after a comma": FORECAST.replace('"Oslo", "country"', '"Oslo","country"'),
    "a line break": FORECAST.replace('{"place": ', '{\n  "place": '),
    "a space inside the call": FORECAST.replace('{"name"', '{ "name"'),
    "a key the function does not take": FORECAST.replace('"days": 2', '"days": 2, "x": 1'),
    "arguments before the name": '{"arguments": {}, "name": "Forecast"}',
}


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_a_call_has_its_whitespace_fixed_and_its_objects_closed(compiler, parser):
    spec = call_grammar(pydantic_tools(), parser, parallel=False)
    assert accepts(compiler, spec, written(FORECAST, parser))
    for name, call in SPACED.items():
        assert not accepts(compiler, spec, written(call, parser)), name


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
}
ANSWERS = [
    (StructuredSpec("json", json.dumps(CITY)), '{"city": "Oslo", "sunny": true}'),
    (StructuredSpec("json", '{"type": "object"}'), '{"any": [1, 2]}'),
    (StructuredSpec("choice", choices=("yes", "no")), "no"),
    (StructuredSpec("regex", "[0-9]+/[0-9]+\n", source="guided_regex"), "3/4\n"),
]


@pytest.mark.parametrize(("answer", "text"), ANSWERS, ids=[a.kind for a, _ in ANSWERS])
def test_auto_tools_beside_a_constraint_take_a_call_or_the_answer(compiler, answer, text):
    spec = call_grammar(pydantic_tools(), "hermes", parallel=True, answer=answer)
    assert spec.source == answer.source  # its errors name the field the answer came by
    assert accepts(compiler, spec, written(FORECAST, "hermes"))
    assert accepts(compiler, spec, text)
    assert not accepts(compiler, spec, "Sure! " + text)
    assert not accepts(compiler, spec, text + written(FORECAST, "hermes"))


def test_a_bare_object_call_and_a_json_answer_both_parse(compiler):
    answer = StructuredSpec("json", json.dumps(CITY))
    spec = call_grammar(pydantic_tools(), "llama3_json", parallel=False, answer=answer)
    assert accepts(compiler, spec, written(FORECAST, "llama3_json"))
    assert accepts(compiler, spec, '{"city": "Oslo", "sunny": true}')


def test_a_grammar_of_the_clients_own_stays_the_whole_constraint():
    lark = StructuredSpec("grammar", 'start: "a"', source="guided_grammar")
    assert call_grammar(pydantic_tools(), "hermes", parallel=True, answer=lark) is lark
