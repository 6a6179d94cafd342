"""vLLM's cache_salt on /v1/completions, /v1/chat/completions and /v1/responses: the same salt
shares the prefix cache (cached_tokens reported), another salt or none gets nothing from it, so
a client cannot learn by cached_tokens what another tenant sent."""

from __future__ import annotations

import uuid

import httpx
import pytest


def secret_prompt() -> str:
    """A prompt no other test sends, several KV blocks long."""
    words = " ".join(f"w{i}" for i in range(24))
    return f"{uuid.uuid4().hex} secret of one tenant: {words}"


def completion(server, prompt: str, salt: str | None) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def test_completions_share_the_cache_within_a_salt_only(server):
    prompt = secret_prompt()
    first = completion(server, prompt, "tenant-a")
    assert first["prompt_tokens"] > 32
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert completion(server, prompt, "tenant-a")["prompt_tokens_details"]["cached_tokens"] >= 32
    # a right guess of tenant-a's prompt looks exactly like a wrong one
    for salt in ("tenant-b", None):
        assert completion(server, prompt, salt)["prompt_tokens_details"]["cached_tokens"] == 0
    assert completion(server, prompt, None)["prompt_tokens_details"]["cached_tokens"] >= 32


def test_chat_and_responses_take_a_salt(server):
    text = secret_prompt()
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 1,
        "temperature": 0,
    }
    responses = {"model": "tiny", "input": text, "max_output_tokens": 1, "temperature": 0}

    def chat_cached(salt: str) -> int:
        reply = httpx.post(
            server.base_url + "/v1/chat/completions", json={**chat, "cache_salt": salt}, timeout=60
        )
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def responses_cached(salt: str) -> int:
        reply = httpx.post(
            server.base_url + "/v1/responses", json={**responses, "cache_salt": salt}, timeout=60
        )
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["input_tokens_details"]["cached_tokens"]

    assert chat_cached("a") == 0
    assert chat_cached("a") >= 32
    assert chat_cached("b") == 0
    # /v1/responses renders the same conversation: the same salt, the same cached blocks
    assert responses_cached("a") >= 32
    assert responses_cached("c") == 0


@pytest.mark.parametrize("salt", ["", 7, ["a"]])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_a_bad_salt_is_a_400_naming_it(server, path, salt):
    body = {
        "/v1/completions": {"prompt": "hi"},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
        "/v1/responses": {"input": "hi"},
    }[path]
    reply = httpx.post(server.base_url + path, json={**body, "cache_salt": salt}, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "cache_salt"
