"""Request fields as the SDKs send them: null for every argument passed as None, fields cpud
does not implement sent with the value that changes nothing, content as lists of text parts,
X-Request-Id, GET /v1/models/{id}, /tokenize without the generation prompt, n up to 128, the
developer role."""

from __future__ import annotations

import httpx
import openai
import pytest

MODEL = "tiny"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
PROMPT = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
RESPONSE = {"model": MODEL, "input": "hi", "max_output_tokens": 2}


def post(server, path: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=60)


def assert_400(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert "Expected" not in error["message"], error  # cpud's words, not the validator's
    return error["message"]


NULL_CHAT = {
    "n": None,
    "logprobs": None,
    "top_logprobs": None,
    "parallel_tool_calls": None,
    "stream": None,
    "ignore_eos": None,
    "min_tokens": None,
    "skip_special_tokens": None,
    "include_stop_str_in_output": None,
    "add_generation_prompt": None,
    "metadata": None,
    "service_tier": None,
    "reasoning_effort": None,
    "prediction": None,
    "modalities": None,
    "audio": None,
    "store": None,
    "tools": None,
    "tool_choice": None,
    "user": None,
    "seed": None,
    "stop": None,
    "functions": None,  # a field cpud does not know at all: null is absent too
}
NULL_PROMPT = {"n": None, "logprobs": None, "echo": None, "stream": None, "min_tokens": None}
NULL_RESPONSE = {
    "reasoning": None,
    "metadata": None,
    "include": None,
    "truncation": None,
    "parallel_tool_calls": None,
    "stream": None,
    "store": None,
    "service_tier": None,
    "text": None,
    "top_logprobs": None,
}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {**CHAT, **NULL_CHAT}),
        ("/v1/completions", {**PROMPT, **NULL_PROMPT}),
        ("/v1/responses", {**RESPONSE, **NULL_RESPONSE}),
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "messages": [
                    {"role": "user", "content": "hi", "name": None, "tool_calls": None},
                    {"role": "assistant", "content": "yo", "refusal": None, "audio": None},
                    {"role": "user", "content": "again"},
                ],
                "stream": True,
                "stream_options": {"include_usage": None, "continuous_usage_stats": None},
            },
        ),
        (
            "/v1/responses",
            {
                **RESPONSE,
                "input": [{"type": "message", "role": "user", "content": "hi", "id": None}],
                "reasoning": {"effort": None, "summary": None},
            },
        ),
        ("/tokenize", {"prompt": "hi", "add_special_tokens": None, "model": None}),
    ],
)
def test_null_is_the_field_left_out(server, path, body):
    response = post(server, path, body)
    assert response.status_code == 200, response.text


def test_null_takes_the_default(server):
    nulls = post(server, "/v1/completions", {**PROMPT, "n": None, "echo": None}).json()
    assert len(nulls["choices"]) == 1
    chat = post(server, "/v1/chat/completions", {**CHAT, "logprobs": None}).json()
    assert chat["choices"][0]["logprobs"] is None
    # null max_tokens of a completion is up to the context (vLLM's meaning), not 16
    free = post(server, "/v1/completions", {**PROMPT, "max_tokens": None, "ignore_eos": True})
    assert free.json()["usage"]["completion_tokens"] > 16


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/chat/completions", {"service_tier": "flex"}, "service_tier"),
        ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
        ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        (
            "/v1/chat/completions",
            {"prediction": {"type": "content", "content": "x"}},
            "prediction",
        ),
        ("/v1/chat/completions", {"reasoning_effort": "extreme"}, "reasoning_effort"),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/responses", {"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ("/v1/responses", {"truncation": "auto"}, "truncation"),
        ("/v1/responses", {"include": ["file_search_call.results"]}, "include"),
        ("/v1/responses", {"background": True}, "background"),
    ],
)
def test_unsupported_values_name_the_field(server, path, extra, param):
    base = CHAT if "chat" in path else RESPONSE
    message = assert_400(post(server, path, {**base, **extra}), param)
    assert param.split(".")[0] in message and "not supported" in message


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        ("/v1/chat/completions", {"service_tier": "auto"}),
        ("/v1/chat/completions", {"modalities": ["text"]}),
        ("/v1/chat/completions", {"store": False, "metadata": {"team": "a", "run": "7"}}),
        ("/v1/responses", {"truncation": "disabled", "metadata": {"k": "v"}}),
        ("/v1/responses", {"include": ["reasoning.encrypted_content"], "store": False}),
        ("/v1/responses", {"service_tier": "default", "background": False}),
    ],
)
def test_values_that_change_nothing_are_accepted(server, path, extra):
    base = CHAT if "chat" in path else RESPONSE
    response = post(server, path, {**base, **extra})
    assert response.status_code == 200, response.text
    if "metadata" in extra and path == "/v1/responses":
        assert response.json()["metadata"] == extra["metadata"]


def test_openai_sdk_passing_none(client):
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        n=None,
        logprobs=None,
        top_logprobs=None,
        metadata=None,
        service_tier=None,
        reasoning_effort=None,
        prediction=None,
        modalities=None,
        audio=None,
        store=None,
        seed=None,
        stop=None,
        extra_body={"parallel_tool_calls": None},
    )
    assert len(chat.choices) == 1
    text = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=2, n=None, logprobs=None, echo=None
    )
    assert len(text.choices) == 1
    response = client.responses.create(
        model=MODEL,
        input="hi",
        max_output_tokens=2,
        reasoning=None,
        metadata=None,
        include=["reasoning.encrypted_content"],
        truncation="disabled",
        parallel_tool_calls=None,
        store=False,
    )
    assert response.status in ("completed", "incomplete")


def tokens(server, body: dict) -> list[int]:
    response = post(server, "/tokenize", {"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_text_parts_are_joined_with_a_newline(server):
    parts = [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]
    joined = tokens(server, {"messages": [{"role": "user", "content": parts}]})
    assert joined == tokens(server, {"messages": [{"role": "user", "content": "Say\nhi"}]})
    assert joined != tokens(server, {"messages": [{"role": "user", "content": "Sayhi"}]})
    items = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Say"},
                {"type": "input_text", "text": "hi"},
            ],
        }
    ]

    def input_tokens(given: object) -> int:
        response = post(server, "/v1/responses", {**RESPONSE, "input": given})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["input_tokens"]

    assert input_tokens(items) == input_tokens("Say\nhi") != input_tokens("Sayhi")


def test_developer_role_is_system_for_a_template_without_it(server):
    def conversation(role: str) -> list[int]:
        messages = [{"role": role, "content": "Be brief."}, {"role": "user", "content": "hi"}]
        return tokens(server, {"messages": messages})

    assert conversation("developer") == conversation("system")
    assert (
        post(
            server,
            "/v1/chat/completions",
            {
                **CHAT,
                "messages": [
                    {"role": "developer", "content": "Be brief."},
                    {"role": "user", "content": "hi"},
                ],
            },
        ).status_code
        == 200
    )


def test_tokenize_without_the_generation_prompt(server):
    messages = [{"role": "user", "content": "hi"}]
    opened = tokens(server, {"messages": messages})
    closed = tokens(server, {"messages": messages, "add_generation_prompt": False})
    assert len(closed) < len(opened) and opened[: len(closed)] == closed
    assert tokens(server, {"messages": messages, "add_generation_prompt": None}) == opened


def test_request_id_header_on_every_route(server):
    mine = "trace-7f3a"
    for method, path, body in [
        ("POST", "/v1/chat/completions", CHAT),
        ("POST", "/v1/completions", PROMPT),
        ("POST", "/v1/responses", RESPONSE),
        ("POST", "/v1/completions", {**PROMPT, "temperature": 9}),  # a 400
        ("GET", "/v1/models", None),
        ("GET", "/health", None),
        ("GET", "/no/such/route", None),
    ]:
        response = httpx.request(
            method, server.base_url + path, json=body, headers={"X-Request-Id": mine}, timeout=60
        )
        assert response.headers.get("x-request-id") == mine, (path, response.headers)
        plain = httpx.request(method, server.base_url + path, json=body, timeout=60)
        given = plain.headers.get("x-request-id")
        assert given and given != mine, (path, plain.headers)
        if plain.status_code == 200 and path.startswith("/v1/") and method == "POST":
            assert given == plain.json()["id"]
    with httpx.stream(
        "POST", server.base_url + "/v1/chat/completions", json={**CHAT, "stream": True}
    ) as stream:
        first = next(line for line in stream.iter_lines() if line.startswith("data: {"))
        assert f'"id": "{stream.headers["x-request-id"]}"' in first


def test_model_by_id(server, client):
    card = httpx.get(server.base_url + f"/v1/models/{MODEL}")
    assert card.status_code == 200
    assert card.json()["id"] == MODEL and card.json()["object"] == "model"
    assert client.models.retrieve(MODEL).id == MODEL
    missing = httpx.get(server.base_url + "/v1/models/org/other-model")
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "org/other-model" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other-model")


def test_n_up_to_128(server):
    body = {**PROMPT, "max_tokens": 1, "n": 128, "temperature": 1.0}
    out = post(server, "/v1/completions", body)
    assert out.status_code == 200, out.text
    assert sorted(c["index"] for c in out.json()["choices"]) == list(range(128))
    over = post(server, "/v1/completions", {**body, "n": 129})
    assert over.status_code == 400 and over.json()["error"]["param"] == "n"


def test_no_cross_origin_access_by_default(server):
    """Without --allowed-origins no preflight is answered and no answer carries CORS headers,
    so a web page can only send what a form could, and the JSON routes refuse that (415)."""
    preflight = httpx.options(
        server.base_url + "/v1/chat/completions",
        headers={
            "Origin": "http://evil.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type",
        },
    )
    assert preflight.status_code == 405
    assert "access-control-allow-origin" not in preflight.headers
    answer = post(server, "/v1/chat/completions", CHAT, Origin="http://evil.example")
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


def tokens_of(logprobs: list[dict]) -> list[str]:
    return [entry["token"] for entry in logprobs]


def test_responses_include_output_text_logprobs(server, client):
    body = {
        **RESPONSE,
        "input": "Count: one two",
        "max_output_tokens": 4,
        "temperature": 0,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
    }
    full = post(server, "/v1/responses", body).json()
    part = full["output"][0]["content"][0]
    logprobs = part["logprobs"]
    assert len(logprobs) == full["usage"]["output_tokens"]
    assert all(len(entry["top_logprobs"]) == 2 and entry["logprob"] <= 0 for entry in logprobs)
    streamed, done = [], None
    with httpx.stream(
        "POST", server.base_url + "/v1/responses", json={**body, "stream": True}
    ) as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                event = httpx.Response(200, content=line[6:]).json()
                if event["type"] == "response.output_text.delta":
                    streamed += event["logprobs"]
                elif event["type"] == "response.output_text.done":
                    done = event["logprobs"]
    # the same tokens (a batch of other size may round the logprobs differently)
    assert done is not None and streamed and len(streamed) <= len(done)
    assert (
        tokens_of(done) == tokens_of(logprobs)
        and tokens_of(streamed) == tokens_of(done)[: len(streamed)]
    )
    assert [e["logprob"] for e in done] == pytest.approx([e["logprob"] for e in logprobs], abs=1e-3)
    sdk = client.responses.create(
        model=MODEL,
        input="Count: one two",
        max_output_tokens=4,
        temperature=0,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    assert [lp.token for lp in sdk.output[0].content[0].logprobs] == tokens_of(logprobs)
    plain = post(server, "/v1/responses", {**RESPONSE, "temperature": 0}).json()
    assert all("logprobs" not in p for p in plain["output"][0]["content"])
