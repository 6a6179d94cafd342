"""The requests vllm-router sends its workers, in vLLM's shapes: the render endpoints it calls
before routing, /tokenize with continue_final_message, and the extension fields it forwards
on every chat and completion request (their values as the router sends them)."""

from __future__ import annotations

import json

import httpx
import pytest

# What vllm-router 0.1.17 forwards for a plain chat request (captured on loopback).
ROUTER_CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hi there"}],
    "stream": False,
    "max_tokens": 5,
    "logprobs": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
    "include_reasoning": True,
}
ROUTER_COMPLETION = {
    "model": "tiny",
    "prompt": "hi there",
    "max_tokens": 5,
    "stream": False,
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}
OPEN_TURN = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "The colour I pick is"},
]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def tokens_of(server, body: dict) -> list[int]:
    answer = post(server, "/tokenize", body)
    assert answer.status_code == 200, answer.text
    return answer.json()["tokens"]


def text_of(server, tokens: list[int]) -> str:
    return post(server, "/detokenize", {"tokens": tokens}).json()["prompt"]


def test_router_bodies_are_served(server):
    chat = post(server, "/v1/chat/completions", ROUTER_CHAT)
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["role"] == "assistant"
    completion = post(server, "/v1/completions", ROUTER_COMPLETION)
    assert completion.status_code == 200, completion.text
    assert completion.json()["object"] == "text_completion"


def test_chat_render_is_the_prompt_the_chat_runs(server):
    answer = post(server, "/v1/chat/completions/render", ROUTER_CHAT)
    assert answer.status_code == 200, answer.text
    rendered = answer.json()
    assert rendered["request_id"].startswith("chatcmpl-")
    assert rendered["token_ids"] == tokens_of(
        server, {"messages": ROUTER_CHAT["messages"], "continue_final_message": False}
    )
    assert rendered["sampling_params"]["max_tokens"] == 5
    assert rendered["sampling_params"]["ignore_eos"] is False
    assert rendered["model"] == "tiny" and rendered["stream"] is False
    assert rendered["features"] is None and rendered["cache_salt"] is None
    # The chat run on the same body counts the same prompt.
    usage = post(server, "/v1/chat/completions", ROUTER_CHAT).json()["usage"]
    assert usage["prompt_tokens"] == len(rendered["token_ids"])


def test_completion_render_answers_one_request_per_prompt(server):
    body = {**ROUTER_COMPLETION, "prompt": ["hi there", "good morning"], "max_tokens": None}
    answer = post(server, "/v1/completions/render", body)
    assert answer.status_code == 200, answer.text
    rendered = answer.json()
    assert [r["token_ids"] for r in rendered] == [
        tokens_of(server, {"prompt": "hi there"}),
        tokens_of(server, {"prompt": "good morning"}),
    ]
    # max_tokens null: up to the context, as vLLM resolves it.
    assert rendered[0]["sampling_params"]["max_tokens"] == 256 - len(rendered[0]["token_ids"])
    assert all(r["request_id"].startswith("cmpl-") for r in rendered)


def test_responses_render_and_salted_render(server):
    answer = post(server, "/v1/responses/render", {"model": "tiny", "input": "hi there"})
    assert answer.status_code == 200, answer.text
    assert (
        answer.json()["token_ids"]
        == post(
            server,
            "/v1/chat/completions/render",
            {"messages": [{"role": "user", "content": "hi there"}]},
        ).json()["token_ids"]
    )
    salted = post(server, "/v1/chat/completions/render", {**ROUTER_CHAT, "cache_salt": "tenant-a"})
    assert salted.json()["cache_salt"] == "tenant-a"


def test_render_refuses_what_the_request_would(server):
    answer = post(server, "/v1/chat/completions/render", {**ROUTER_CHAT, "model": "other"})
    assert answer.status_code == 404
    long_prompt = {**ROUTER_COMPLETION, "prompt": list(range(300))}
    answer = post(server, "/v1/completions/render", long_prompt)
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "context_length_exceeded"


def test_continue_final_message_leaves_the_turn_open(server):
    closed = tokens_of(server, {"messages": OPEN_TURN, "add_generation_prompt": False})
    opened = tokens_of(
        server,
        {"messages": OPEN_TURN, "add_generation_prompt": False, "continue_final_message": True},
    )
    assert text_of(server, opened).endswith("The colour I pick is")
    assert not text_of(server, closed).endswith("The colour I pick is")
    assert closed[: len(opened)] == opened and len(closed) > len(opened)


def test_continue_final_message_with_a_generation_prompt_is_a_400(server):
    body = {"messages": OPEN_TURN, "continue_final_message": True}
    for path in ("/tokenize", "/v1/chat/completions"):
        answer = post(server, path, body)
        assert answer.status_code == 400
        assert answer.json()["error"]["param"] == "continue_final_message"
        assert "add_generation_prompt" in answer.json()["error"]["message"]


def continued_chat(stream: bool) -> dict:
    return {
        "model": "tiny",
        "messages": OPEN_TURN,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "echo": True,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def test_echo_on_chat_starts_the_answer_with_the_final_message(server):
    plain = post(server, "/v1/chat/completions", {**continued_chat(False), "echo": False})
    echoed = post(server, "/v1/chat/completions", continued_chat(False))
    assert echoed.status_code == 200, echoed.text
    content = echoed.json()["choices"][0]["message"]["content"]
    assert content == "The colour I pick is" + plain.json()["choices"][0]["message"]["content"]
    streamed = ""
    with httpx.stream(
        "POST", server.base_url + "/v1/chat/completions", json=continued_chat(True), timeout=60
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                streamed += delta.get("content") or ""
    assert streamed == content


def test_echo_without_an_assistant_final_message_adds_nothing(server):
    body = {**ROUTER_CHAT, "echo": True, "temperature": 0, "ignore_eos": True}
    echoed = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]
    plain = post(server, "/v1/chat/completions", {**body, "echo": False}).json()["choices"][0]
    assert echoed["content"] == plain["message"]["content"]


def test_no_stop_trim_keeps_the_stop_string(server):
    body = {"model": "tiny", "prompt": "hi there", "max_tokens": 12, "temperature": 0}
    body["ignore_eos"] = True
    text = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    stop = text[len(text) // 2 :][:1]
    assert stop
    trimmed = post(server, "/v1/completions", {**body, "stop": [stop]}).json()["choices"][0]
    kept = post(server, "/v1/completions", {**body, "stop": [stop], "no_stop_trim": True})
    kept_text = kept.json()["choices"][0]["text"]
    assert not trimmed["text"].endswith(stop) or trimmed["text"] == ""
    assert kept_text == trimmed["text"] + stop


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/chat/completions", "return_hidden_states", True),
        ("/v1/completions", "return_hidden_states", True),
        ("/v1/chat/completions", "priority", 1),
        ("/v1/completions", "use_beam_search", True),
        ("/v1/completions", "length_penalty", 0.5),
        ("/v1/chat/completions", "kv_transfer_params", {"do_remote_decode": True}),
    ],
)
def test_unsupported_router_values_are_400s_naming_them(server, path, field, value):
    base = ROUTER_CHAT if "chat" in path else ROUTER_COMPLETION
    answer = post(server, path, {**base, field: value})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == field


def test_tokenize_token_strs(server):
    answer = post(server, "/tokenize", {"prompt": "hi there", "return_token_strs": True}).json()
    assert len(answer["token_strs"]) == answer["count"] == len(answer["tokens"])
    assert all(isinstance(piece, str) for piece in answer["token_strs"])


def test_worker_info_endpoints(server):
    assert httpx.get(server.base_url + "/health_generate").json() == {"status": "ok"}
    info = httpx.get(server.base_url + "/get_model_info").json()
    assert info["served_model_names"] == ["tiny"] and info["is_generation"] is True
    assert info["max_model_len"] == 256
    settings = httpx.get(server.base_url + "/get_server_info").json()
    assert settings["block_size"] == 16 and settings["num_kv_blocks"] > 0
    assert settings["served_model_names"] == ["tiny"]


def stream_open(server, max_tokens: int = 64):
    """A streamed completion holding KV blocks until it is closed (its first event read)."""
    body = {"prompt": "hello " * 40, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    stream = httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60)
    response = stream.__enter__()
    lines = response.iter_lines()
    next(line for line in lines if line.startswith("data: {"))
    return stream, lines


def test_get_load_counts_requests_in_flight(server):
    assert httpx.get(server.base_url + "/get_load").json() == {"load": 0}
    stream, lines = stream_open(server, max_tokens=95)  # the most the context holds
    try:
        assert httpx.get(server.base_url + "/get_load").json()["load"] >= 1
        flush = httpx.post(server.base_url + "/flush_cache")
        assert flush.status_code == 409
        assert flush.json()["error"]["code"] == "requests_running"
    finally:
        for _ in lines:
            pass
        stream.__exit__(None, None, None)


def test_flush_cache_empties_the_prefix_cache(server):
    body = {"prompt": "a long shared prefix " * 20, "max_tokens": 1}

    def cached() -> int:
        answer = post(server, "/v1/completions", body).json()
        return answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached()
    assert cached() > 0
    for path in ("/flush_cache", "/reset_prefix_cache"):
        flushed = httpx.post(server.base_url + path)
        assert flushed.status_code == 200 and flushed.json() == {"flushed": True}
        assert cached() == 0


def test_vllm_fields_that_change_nothing_are_accepted(server):
    body = {**ROUTER_COMPLETION, "spaces_between_special_tokens": False, "priority": 0}
    body |= {"use_beam_search": False, "length_penalty": 1.0, "kv_transfer_params": None}
    assert post(server, "/v1/completions", body).status_code == 200


def test_truncate_prompt_tokens_keeps_the_prompts_end(server):
    prompt = "one two three four five six seven eight nine ten"
    tokens = tokens_of(server, {"prompt": prompt})
    body = {"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": 3, "echo": True}
    answer = post(server, "/v1/completions", body).json()
    assert answer["usage"]["prompt_tokens"] == 3
    assert answer["choices"][0]["text"].startswith(text_of(server, tokens[-3:]))
    rendered = post(server, "/v1/completions/render", body).json()[0]
    assert rendered["token_ids"] == tokens[-3:]
    chat = {**ROUTER_CHAT, "truncate_prompt_tokens": 4}
    assert post(server, "/v1/chat/completions", chat).json()["usage"]["prompt_tokens"] == 4
    whole = post(server, "/v1/completions", {**body, "truncate_prompt_tokens": 256})
    assert whole.json()["usage"]["prompt_tokens"] == len(tokens)


def test_add_special_tokens_on_chat_adds_what_a_prompt_gets(server):
    plain = post(server, "/v1/chat/completions/render", ROUTER_CHAT).json()["token_ids"]
    marked = post(
        server, "/v1/chat/completions/render", {**ROUTER_CHAT, "add_special_tokens": True}
    ).json()["token_ids"]
    added = len(tokens_of(server, {"prompt": "hi", "add_special_tokens": True})) - len(
        tokens_of(server, {"prompt": "hi", "add_special_tokens": False})
    )
    assert len(marked) - len(plain) == added
    start = next(
        i for i in range(len(marked) - len(plain) + 1) if marked[i:][: len(plain)] == plain
    )
    assert marked[start : start + len(plain)] == plain


@pytest.mark.parametrize("metrics_need_key", [False, True])
def test_get_load_is_open_where_metrics_are(model_factory, metrics_need_key):
    """vllm-router polls /get_load without the API key: it tells no more than /metrics does,
    so it is as open as /metrics."""
    from starlette.testclient import TestClient

    from cpud.frontend.app import create_app
    from cpud.frontend.state import ServerConfig, ServerState
    from cpud.text.tokenizer import Tokenizer

    config = ServerConfig(("tiny",), 256, api_key="k3y", metrics_need_key=metrics_need_key)
    state = ServerState(config, Tokenizer(model_factory("qwen3")))
    try:
        client = TestClient(create_app(state))
        load = client.get("/get_load")
        assert load.status_code == (401 if metrics_need_key else 200)
        assert client.get("/get_load", headers={"Authorization": "Bearer k3y"}).json() == {
            "load": 0
        }
        assert client.get("/get_server_info").status_code == 401
    finally:
        state.close()
