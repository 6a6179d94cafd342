"""Anthropic's Messages API over raw HTTP against the default model behind an API key: the
Message shape, stop reasons, tool_use / tool_result, the streamed event order, count_tokens,
Anthropic-shaped errors, x-api-key beside Bearer, metrics and access lines."""

from __future__ import annotations

import json
import re
import time

import httpx
import jsonschema
import pytest

from cpud.frontend.anthropic_answer import error_response
from cpud.frontend.errors import APIError
from cpud.model.default_model import default_model_path
from cpud_server_helpers import start_server

KEY = "anthropic-test-key"
HEADERS = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
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


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    srv = start_server(
        default_model_path(),
        tmp_path_factory.mktemp("anthropic") / "serve.log",
        "--max-model-len",
        "2048",
        "--kv-cache-space",
        "0.25",
        "--no-kv-cache-pretouch",
        env={"CPUD_API_KEY": KEY},
    )
    yield srv
    srv.stop()


def post(smol, path: str = "/v1/messages", headers: dict | None = None, **body) -> httpx.Response:
    body = {"model": "tiny", "max_tokens": 24, "temperature": 0, "messages": ASK, **body}
    return httpx.post(
        smol.base_url + path,
        json=body,
        headers=HEADERS if headers is None else headers,
        timeout=120,
    )


def events(smol, **body) -> list[tuple[str, dict]]:
    """(event name, data) of a streamed answer; every data's type is its event's name."""
    body = {"model": "tiny", "max_tokens": 24, "temperature": 0, "messages": ASK, **body}
    body["stream"] = True
    found = []
    with httpx.stream(
        "POST", smol.base_url + "/v1/messages", json=body, headers=HEADERS, timeout=120
    ) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"].startswith(
            "text/event-stream"
        )
        name = None
        for line in answer.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                found.append((name, data))
    return found


def check_order(found: list[tuple[str, dict]]) -> None:
    """Anthropic's sequence: message_start, pings anywhere, blocks started, delta'd and stopped
    one at a time with increasing indices, then message_delta and message_stop."""
    names = [name for name, _ in found if name != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    open_index, next_index = None, 0
    for name, data in found[1:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == next_index
            open_index, next_index = next_index, next_index + 1
        elif name == "content_block_delta":
            assert data["index"] == open_index
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
        else:
            assert name == "ping", name
    assert open_index is None


def test_a_text_answer_is_a_message(smol):
    answer = post(
        smol,
        system=[{"type": "text", "text": "You answer briefly."}],
        messages=[
            {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello, how can I help?"}]},
            {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
        ],
        metadata={"user_id": "u-1"},
        top_k=5,
        top_p=0.9,
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["type"] == "message" and body["role"] == "assistant"
    assert body["id"].startswith("msg_") and body["model"] == "tiny"
    [block] = body["content"]
    assert block["type"] == "text" and block["text"]
    assert body["stop_reason"] in ("end_turn", "max_tokens") and body["stop_sequence"] is None
    usage = body["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] > 10
    assert 0 < usage["output_tokens"] <= 24


def test_max_tokens_and_stop_sequences_name_the_stop(smol):
    cut = post(smol, max_tokens=3, messages=[{"role": "user", "content": "Tell me a story."}])
    assert cut.json()["stop_reason"] == "max_tokens" and cut.json()["usage"]["output_tokens"] == 3
    ask = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    full = post(smol, messages=ask, max_tokens=40).json()["content"][0]["text"]
    assert "4, 5" in full, full
    stopped = post(smol, messages=ask, max_tokens=40, stop_sequences=["5", "zzz"]).json()
    assert stopped["stop_reason"] == "stop_sequence" and stopped["stop_sequence"] == "5"
    assert stopped["content"][0]["text"] == full[: full.index("5")]


def test_a_forced_tool_use_and_its_result_round_trip(smol):
    first = post(
        smol, max_tokens=60, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}
    )
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["stop_reason"] == "tool_use"
    [call] = [b for b in body["content"] if b["type"] == "tool_use"]
    assert call["name"] == "get_weather" and call["id"].startswith("toolu_")
    jsonschema.validate(call["input"], WEATHER["input_schema"])
    result = {"type": "tool_result", "tool_use_id": call["id"], "content": "Sunny, 24 C"}
    second = post(
        smol,
        tools=[WEATHER],
        messages=[
            *ASK,
            {"role": "assistant", "content": body["content"]},
            {"role": "user", "content": [result, {"type": "text", "text": "Answer in words."}]},
        ],
    )
    assert second.status_code == 200, second.text
    answer = second.json()
    assert answer["content"][0]["type"] == "text" and answer["content"][0]["text"]
    assert answer["stop_reason"] in ("end_turn", "max_tokens")


def test_output_config_format_makes_the_text_json_of_the_schema(smol):
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    answer = post(
        smol,
        max_tokens=30,
        messages=[{"role": "user", "content": "Is Paris in France?"}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    assert answer.status_code == 200, answer.text
    jsonschema.validate(json.loads(answer.json()["content"][0]["text"]), schema)


def test_a_stream_follows_anthropics_event_order(smol):
    # Cached prompt blocks and a fresh prefill may round a near tie apart: both cached here.
    post(smol, max_tokens=1)
    found = events(smol, max_tokens=12)
    check_order(found)
    start = found[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == []
    assert start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    starts = [d for n, d in found if n == "content_block_start"]
    assert starts == [
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    ]
    deltas = [d["delta"] for n, d in found if n == "content_block_delta"]
    assert deltas and all(d["type"] == "text_delta" for d in deltas)
    streamed = "".join(d["text"] for d in deltas)
    whole = post(smol, max_tokens=12).json()
    assert streamed == whole["content"][0]["text"]
    final = found[-2][1]
    assert final["delta"] == {"stop_reason": whole["stop_reason"], "stop_sequence": None}
    assert final["usage"]["output_tokens"] == whole["usage"]["output_tokens"]


def test_a_streamed_tool_use_sends_its_input_as_json_deltas(smol):
    found = events(
        smol,
        max_tokens=60,
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    check_order(found)
    [start] = [d for n, d in found if n == "content_block_start"]
    block = start["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["input"] == {}
    assert block["id"].startswith("toolu_")
    fragments = [
        d["delta"]["partial_json"]
        for n, d in found
        if n == "content_block_delta" and d["index"] == start["index"]
    ]
    assert len(fragments) > 1
    jsonschema.validate(json.loads("".join(fragments)), WEATHER["input_schema"])
    assert found[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_count_tokens_is_the_prompt_a_message_would_read(smol):
    body = {
        "model": "tiny",
        "system": "You answer briefly.",
        "messages": ASK,
        "tools": [WEATHER],
    }
    counted = httpx.post(
        smol.base_url + "/v1/messages/count_tokens", json=body, headers=HEADERS, timeout=60
    )
    assert counted.status_code == 200, counted.text
    usage = post(smol, max_tokens=1, **body).json()["usage"]
    assert counted.json() == {
        "input_tokens": usage["input_tokens"] + usage["cache_read_input_tokens"]
    }


def test_a_final_assistant_message_is_continued(smol):
    answer = post(
        smol,
        max_tokens=8,
        messages=[
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is"},
        ],
    )
    assert answer.status_code == 200, answer.text
    assert "Paris" in answer.json()["content"][0]["text"]


NULLS = {
    "system": None,
    "stop_sequences": None,
    "temperature": None,
    "top_p": None,
    "top_k": None,
    "metadata": None,
    "tools": None,
    "tool_choice": None,
    "thinking": None,
    "stream": None,
    "service_tier": None,
    "mcp_servers": None,
    "container": None,
    "context_management": None,
}


def test_null_fields_are_absent_ones(smol):
    answer = post(smol, max_tokens=2, **NULLS)
    assert answer.status_code == 200, answer.text
    disabled = post(
        smol,
        max_tokens=2,
        thinking={"type": "disabled"},
        service_tier="auto",
        cache_control={"type": "ephemeral"},
    )
    assert disabled.status_code == 200, disabled.text


REFUSED = [
    ({"max_tokens": None}, "max_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"thinking": {"type": "enabled"}}, "budget_tokens"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
    ({"output_format": {"type": "json_schema"}}, "output_format"),
    ({"output_config": {"effort": "high"}}, "effort"),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image", "source": {"type": "base64", "data": "AA"}}],
                }
            ]
        },
        "image blocks",
    ),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
    ({"tools": [{"name": "f"}]}, "input_schema"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, "nope"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "k": 1}]}]}, "k"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    (
        {
            "messages": [
                *ASK,
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]},
            ]
        },
        "toolu_x",
    ),
]


@pytest.mark.parametrize("fields,named", REFUSED, ids=[named for _, named in REFUSED])
def test_what_cannot_be_served_is_an_anthropic_400_naming_it(smol, fields, named):
    answer = post(smol, **fields)
    assert answer.status_code == 400, answer.text
    body = answer.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert named in body["error"]["message"]


def test_errors_have_anthropics_shape_and_status(smol):
    base = smol.base_url
    unknown = post(smol, model="claude-nope")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["type"] == "not_found_error"
    for denied in (
        post(smol, headers={}),
        post(smol, headers={"x-api-key": "wrong"}),
        post(smol, path="/v1/messages/count_tokens", headers={"Authorization": "Bearer no"}),
    ):
        assert denied.status_code == 401
        assert denied.json()["error"]["type"] == "authentication_error"
        assert denied.json()["type"] == "error"
    # The OpenAI routes keep OpenAI's shape.
    openai = httpx.post(base + "/v1/chat/completions", json={"messages": ASK})
    assert openai.status_code == 401 and openai.json()["error"]["code"] == "invalid_api_key"
    wrong_method = httpx.get(base + "/v1/messages", headers=HEADERS)
    assert wrong_method.status_code == 405 and wrong_method.json()["type"] == "error"
    no_route = httpx.post(base + "/v1/messages/batches", json={}, headers=HEADERS)
    assert no_route.status_code == 404
    assert no_route.json()["error"]["type"] == "not_found_error"
    bad_json = httpx.post(
        base + "/v1/messages",
        content=b"{",
        headers={**HEADERS, "content-type": "application/json"},
    )
    assert bad_json.status_code == 400
    assert bad_json.json()["error"]["type"] == "invalid_request_error"


def test_either_key_header_opens_every_route(smol):
    bearer = {"Authorization": f"Bearer {KEY}"}
    assert post(smol, max_tokens=1, headers=bearer).status_code == 200
    assert httpx.get(smol.base_url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    chat = {"model": "tiny", "messages": ASK, "max_tokens": 1}
    opened = httpx.post(
        smol.base_url + "/v1/chat/completions", json=chat, headers={"x-api-key": KEY}, timeout=60
    )
    assert opened.status_code == 200, opened.text


@pytest.mark.parametrize(
    "status,kind",
    [
        (429, "rate_limit_error"),
        (503, "overloaded_error"),
        (500, "api_error"),
        (413, "request_too_large"),
    ],
)
def test_server_side_errors_map_to_anthropics_types(status, kind):
    answer = error_response("/v1/messages", APIError(status, "why", headers={"Retry-After": "5"}))
    assert answer.status_code == status and answer.headers["retry-after"] == "5"
    assert json.loads(answer.body) == {"type": "error", "error": {"type": kind, "message": "why"}}


ACCESS = re.compile(
    r'"POST /v1/messages" 200 [\d.]+s id=(msg_\w+) model=tiny prompt_tokens=\d+ '
    r"completion_tokens=(\d+)"
)


def test_metrics_and_access_lines_count_the_new_routes(smol):
    assert post(smol, max_tokens=0).status_code == 400
    answer = post(smol, max_tokens=2).json()
    deadline = time.monotonic() + 10
    while answer["id"] not in smol.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = [m for m in map(ACCESS.search, smol.log().splitlines()) if m]
    [line] = [m for m in lines if m.group(1) == answer["id"]]
    assert int(line.group(2)) == answer["usage"]["output_tokens"]
    metrics = httpx.get(smol.base_url + "/metrics", headers=HEADERS).text
    assert 'cpud_requests_total{endpoint="/v1/messages",status="200"}' in metrics
    assert 'cpud_requests_total{endpoint="/v1/messages",status="400"}' in metrics
