"""Every malformed or out-of-range request gets a 4xx in OpenAI's error shape naming the
field, and the server keeps serving afterwards."""

from __future__ import annotations

import httpx
import pytest

OK_PROMPT = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
OK_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LONG = "word " * 400  # ~400+ tokens against --max-model-len 256

CASES = [
    # (name, path, body (dict or raw bytes), status, param, code)
    ("invalid json", "/v1/completions", b'{"prompt": "hi",', 400, None, None),
    ("not utf-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None, None),
    ("wrong type", "/v1/completions", {**OK_PROMPT, "max_tokens": "ten"}, 400, "max_tokens", None),
    ("missing prompt", "/v1/completions", {"model": "tiny"}, 400, "prompt", None),
    (
        "unknown model",
        "/v1/completions",
        {**OK_PROMPT, "model": "gpt-9"},
        404,
        "model",
        "model_not_found",
    ),
    (
        "prompt too long",
        "/v1/completions",
        {**OK_PROMPT, "prompt": LONG},
        400,
        "prompt",
        "context_length_exceeded",
    ),
    (
        "max_tokens too large",
        "/v1/completions",
        {**OK_PROMPT, "max_tokens": 10_000},
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    ("max_tokens zero", "/v1/completions", {**OK_PROMPT, "max_tokens": 0}, 400, "max_tokens", None),
    ("n over cap", "/v1/completions", {**OK_PROMPT, "n": 129}, 400, "n", None),
    ("logprobs over cap", "/v1/completions", {**OK_PROMPT, "logprobs": 21}, 400, "logprobs", None),
    (
        "too many stops",
        "/v1/completions",
        {**OK_PROMPT, "stop": [str(i) for i in range(17)]},
        400,
        "stop",
        None,
    ),
    (
        "temperature high",
        "/v1/completions",
        {**OK_PROMPT, "temperature": 5},
        400,
        "temperature",
        None,
    ),
    (
        "temperature negative",
        "/v1/completions",
        {**OK_PROMPT, "temperature": -0.1},
        400,
        "temperature",
        None,
    ),
    (
        "temperature infinite",
        "/v1/completions",
        b'{"prompt": "hi", "temperature": 1e999}',
        400,
        "temperature",
        None,
    ),
    ("top_p zero", "/v1/completions", {**OK_PROMPT, "top_p": 0}, 400, "top_p", None),
    ("top_p over one", "/v1/completions", {**OK_PROMPT, "top_p": 1.5}, 400, "top_p", None),
    (
        "token id outside vocab",
        "/v1/completions",
        {**OK_PROMPT, "prompt": [1, 10**9]},
        400,
        "prompt",
        None,
    ),
    ("negative token id", "/v1/completions", {**OK_PROMPT, "prompt": [1, -5]}, 400, "prompt", None),
    ("empty prompt list", "/v1/completions", {**OK_PROMPT, "prompt": []}, 400, "prompt", None),
    ("empty prompt string", "/v1/completions", {**OK_PROMPT, "prompt": ""}, 400, "prompt", None),
    (
        "mixed prompt list",
        "/v1/completions",
        {**OK_PROMPT, "prompt": ["a", 1]},
        400,
        "prompt",
        None,
    ),
    ("empty messages", "/v1/chat/completions", {**OK_CHAT, "messages": []}, 400, "messages", None),
    (
        "message without role",
        "/v1/chat/completions",
        {**OK_CHAT, "messages": [{"content": "x"}]},
        400,
        "messages",
        None,
    ),
    (
        "image part",
        "/v1/chat/completions",
        {**OK_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages",
        None,
    ),
    (
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        {**OK_CHAT, "top_logprobs": 2},
        400,
        "top_logprobs",
        None,
    ),
    (
        "top_logprobs over cap",
        "/v1/chat/completions",
        {**OK_CHAT, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
        None,
    ),
    (
        "chat_template_kwargs sets messages",
        "/v1/chat/completions",
        {**OK_CHAT, "chat_template_kwargs": {"messages": []}},
        400,
        "chat_template_kwargs",
        None,
    ),
    ("detokenize outside vocab", "/detokenize", {"tokens": [10**9]}, 400, "tokens", None),
    ("tokenize needs one input", "/tokenize", {}, 400, "prompt", None),
    (
        "body too large",
        "/v1/completions",
        b'{"prompt": "' + b"a" * (5 << 20) + b'"}',
        413,
        None,
        "request_too_large",
    ),
]


@pytest.mark.parametrize("name,path,body,status,param,code", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_openai_error(server, name, path, body, status, param, code):
    url = server.base_url + path
    if isinstance(body, bytes):
        response = httpx.post(
            url, content=body, headers={"content-type": "application/json"}, timeout=30
        )
    else:
        response = httpx.post(url, json=body, timeout=30)
    assert response.status_code == status, response.text
    if status == 413:  # the unread rest of the body is not waited for
        assert response.headers.get("connection") == "close"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code
    # Still serving.
    ok = httpx.post(server.base_url + "/v1/completions", json=OK_PROMPT, timeout=30)
    assert ok.status_code == 200


def test_unknown_route_and_method(server):
    assert httpx.get(server.base_url + "/v1/nothing").status_code == 404
    assert httpx.get(server.base_url + "/v1/completions").status_code == 405
    assert "error" in httpx.get(server.base_url + "/v1/nothing").json()


def test_tokenize_roundtrip(server):
    tokens = httpx.post(server.base_url + "/tokenize", json={"prompt": "héllo 你好"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 256
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text["prompt"] == "héllo 你好"
    chat = httpx.post(
        server.base_url + "/tokenize", json={"messages": [{"role": "user", "content": "x"}]}
    ).json()
    assert chat["count"] > 3


def test_openapi_describes_request_types(server):
    doc = httpx.get(server.base_url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    assert {"CompletionRequest", "ChatCompletionRequest"} <= set(schemas)
    temperature = schemas["CompletionRequest"]["properties"]["temperature"]
    assert "2.0" in str(temperature)
    assert "/v1/chat/completions" in doc["paths"]
