"""/v1/responses, stateless: text, function calls and their outputs as input items,
text.format json_schema, streamed events in OpenAI's order, 400 for what it cannot serve."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def post(smol, **body) -> httpx.Response:
    body = {"model": "tiny", "max_output_tokens": 40, "temperature": 0, **body}
    return httpx.post(smol.base_url + "/v1/responses", json=body, timeout=120)


def test_text_response_with_the_openai_client(smol_client):
    response = smol_client.responses.create(
        model="tiny", input="Say hello.", instructions="Be brief.", max_output_tokens=8
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete")
    assert response.output[0].type == "message" and response.output_text
    assert response.usage.input_tokens > 0 and response.usage.output_tokens <= 8


def test_function_call_then_its_output_round_trip(smol_client):
    first = smol_client.responses.create(
        model="tiny",
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,
    )
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    second = smol_client.responses.create(
        model="tiny",
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"},
        ],
        tools=[WEATHER],
        max_output_tokens=30,
        temperature=0,
    )
    assert second.output[0].type == "message" and second.output_text


def test_streamed_function_call_events(smol_client):
    stream = smol_client.responses.create(
        model="tiny",
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
        stream=True,
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = kinds.index("response.output_item.added")
    assert events[added].item.type == "function_call"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(deltas) > 1 and "".join(deltas) == done.arguments
    jsonschema.validate(json.loads(done.arguments), WEATHER["parameters"])
    assert events[-1].response.output[0].arguments == done.arguments


def test_streamed_text_and_json_format(smol):
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    body = {
        "model": "tiny",
        "input": "Is Paris in France?",
        "text": {"format": {"type": "json_schema", "name": "a", "schema": schema}},
        "max_output_tokens": 30,
        "stream": True,
    }
    kinds, text = [], ""
    with httpx.stream("POST", smol.base_url + "/v1/responses", json=body, timeout=60) as answer:
        for line in answer.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                kinds.append(event["type"])
                text += event.get("delta", "")
    assert kinds.index("response.output_text.delta") > kinds.index("response.content_part.added")
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"type": "reasoning", "summary": [], "extra": 1}]}, "input[0].extra"),
        ({"input": [{"role": "user", "content": "x", "extra": 1}]}, "input[0].extra"),
    ],
)
def test_unsupported_fields_are_400s_naming_them(smol, extra, param):
    answer = post(smol, **{"input": "hi", **extra})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
