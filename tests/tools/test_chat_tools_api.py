"""/v1/chat/completions and /v1/completions with tools, response_format, vLLM's guided_*
extras and logit_bias, over HTTP against the default model: answers in OpenAI's shapes,
streamed tool-call deltas as OpenAI sends them, 400s naming what cannot be served."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from tool_models import WEATHER

TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def chat(smol, **body) -> httpx.Response:
    body = {"model": "tiny", "messages": ASK, "max_tokens": 48, "temperature": 0, **body}
    return httpx.post(smol.base_url + "/v1/chat/completions", json=body, timeout=120)


def events(smol, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", smol.base_url + path, json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def check_call(call: dict, tool: dict) -> dict:
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == tool["function"]["name"]
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


@pytest.mark.parametrize("temperature", [0, 1])
def test_required_tool_choice_returns_valid_calls(smol, temperature):
    answer = chat(smol, tools=[WEATHER, TIME], tool_choice="required", temperature=temperature)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert calls
    for call in calls:
        check_call(call, WEATHER if call["function"]["name"] == "get_weather" else TIME)


def test_named_tool_choice_calls_that_function_once(smol):
    choice = {"type": "function", "function": {"name": "get_time"}}
    answer = chat(smol, tools=[WEATHER, TIME], tool_choice=choice, seed=3, temperature=1)
    body = answer.json()["choices"][0]
    assert body["finish_reason"] == "tool_calls"
    assert body["message"]["content"] is None
    [call] = body["message"]["tool_calls"]
    check_call(call, TIME)


def test_streamed_tool_call_deltas_are_shaped_as_openai_sends_them(smol):
    body = {
        "model": "tiny",
        "messages": ASK,
        "max_tokens": 64,
        "temperature": 0,
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "stream": True,
    }
    chunks = events(smol, "/v1/chat/completions", body)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    first = calls[0]
    assert set(first) == {"index", "id", "type", "function"}
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    assert all(set(c) == {"index", "function"} and c["index"] == 0 for c in calls[1:])
    assert len(calls) > 3  # the arguments arrive in fragments
    arguments = "".join(c["function"].get("arguments", "") for c in calls)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_round_trip_with_a_tool_result_renders_and_answers(smol):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"},
    ]
    answer = chat(smol, messages=messages, tools=[WEATHER], tool_choice="none")
    assert answer.status_code == 200, answer.text
    message = answer.json()["choices"][0]["message"]
    assert message.get("tool_calls") is None and message["content"]
    tokens = httpx.post(
        smol.base_url + "/tokenize", json={"model": "tiny", "messages": messages}, timeout=60
    ).json()["count"]
    assert tokens > 20


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "sunny": {"type": "boolean"},
        "sky": {"enum": ["clear", "cloudy", "rain"]},
    },
    "required": ["city", "sunny", "sky"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_response_format_is_followed(smol, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    body = {
        "model": "tiny",
        "messages": ASK,
        "max_tokens": 60,
        "temperature": 1,
        "seed": 5,
        "response_format": fmt,
    }
    if stream:
        chunks = events(smol, "/v1/chat/completions", {**body, "stream": True})
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    else:
        answer = httpx.post(smol.base_url + "/v1/chat/completions", json=body, timeout=120)
        text = answer.json()["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(text), SCHEMA)


def test_completions_take_guided_choice_and_regex(smol):
    base = {"model": "tiny", "prompt": "The sky is", "max_tokens": 12, "temperature": 1}
    url = smol.base_url + "/v1/completions"
    choice = httpx.post(url, json={**base, "guided_choice": ["blue", "green"]}, timeout=60)
    assert choice.json()["choices"][0]["text"] in ("blue", "green")
    regex = httpx.post(url, json={**base, "structured_outputs": {"regex": "[0-9]{3}"}}, timeout=60)
    assert regex.json()["choices"][0]["text"].isdigit()


def test_logit_bias_bans_and_forces_tokens(smol):
    tokens = httpx.post(
        smol.base_url + "/tokenize", json={"model": "tiny", "prompt": " yes"}, timeout=60
    ).json()["tokens"]
    body = {"model": "tiny", "prompt": "Answer:", "max_tokens": 3, "temperature": 1, "seed": 1}
    forced = httpx.post(
        smol.base_url + "/v1/completions",
        json={**body, "logit_bias": {str(tokens[-1]): 100}},
        timeout=60,
    ).json()
    assert forced["choices"][0]["text"] == " yes" * 3


def test_usage_reports_cached_prompt_tokens_and_streams_continuously(smol):
    messages = [{"role": "user", "content": "Name three colours of the rainbow, please. " * 4}]
    for _ in range(2):
        usage = chat(smol, messages=messages, max_tokens=2).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 16
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "stream": True}
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = events(smol, "/v1/chat/completions", {**body, "stream_options": options})
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 4 and len(counts) >= 3
    assert all(c["usage"]["prompt_tokens"] == usage["prompt_tokens"] for c in chunks)


BAD = [
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
        "tool_choice",
    ),
    ({"tool_choice": "required"}, "tool_choice"),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
            ]
        },
        "tools",
    ),
    ({"tools": [{"type": "function", "function": {"name": "f"}, "extra": 1}]}, "tools[0].extra"),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "bogus"}}},
                    },
                }
            ]
        },
        "tools",
    ),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]}, "messages"),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}},
                },
            }
        },
        "response_format",
    ),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"store": True}, "store"),
    (
        {"stream_options": {"include_usage": True, "other": 1}, "stream": True},
        "stream_options.other",
    ),
]


@pytest.mark.parametrize(("extra", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_requests_are_400s_naming_the_field(smol, extra, param):
    answer = chat(smol, **extra)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert httpx.get(smol.base_url + "/health", timeout=10).status_code == 200
