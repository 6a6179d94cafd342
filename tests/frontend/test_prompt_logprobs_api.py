"""Prompt logprobs over HTTP: echo with logprobs in the legacy completions shape (prompt
tokens first, null for the first one), echo with max_tokens 0, vLLM's prompt_logprobs field on
completions and chat, the stream, and /tokenizer_info as lm-eval's remote tokenizer reads it."""

from __future__ import annotations

import json

import httpx
import pytest

MODEL = "tiny"
IDS = [72, 262, 265, 117, 334, 489, 40, 41, 300, 12]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json={"model": MODEL, **body}, timeout=60)


def completion(server, **body) -> dict:
    response = post(server, "/v1/completions", {"temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_echo_with_logprobs_gives_prompt_then_completion_logprobs(server):
    body = completion(server, prompt=IDS, echo=True, logprobs=2, max_tokens=3)
    choice = body["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(IDS) + 3
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(isinstance(v, float) for v in logprobs["token_logprobs"][1:])
    for token, value, top in zip(
        logprobs["tokens"][1:], logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:]
    ):
        assert top[token] == value and len(top) <= 3  # the 2 best, and the token itself
    assert logprobs["text_offset"][: len(IDS)] == sorted(logprobs["text_offset"][: len(IDS)])
    # the prompt part is vLLM's prompt_logprobs, which the choice carries as well
    prompt_logprobs = choice["prompt_logprobs"]
    assert len(prompt_logprobs) == len(IDS) and prompt_logprobs[0] is None
    for position in range(1, len(IDS)):
        entry = prompt_logprobs[position][str(IDS[position])]
        assert logprobs["token_logprobs"][position] == entry["logprob"]
    # the completion part is what the same request without echo returns
    plain = completion(server, prompt=IDS, logprobs=2, max_tokens=3)["choices"][0]
    assert logprobs["token_logprobs"][len(IDS) :] == plain["logprobs"]["token_logprobs"]
    assert choice["text"].endswith(plain["text"])
    assert body["usage"]["prompt_tokens"] == len(IDS)


def test_echo_with_max_tokens_zero_scores_the_prompt_alone(server):
    scored = completion(server, prompt=IDS, echo=True, logprobs=1, max_tokens=0)["choices"][0]
    full = completion(server, prompt=IDS, echo=True, logprobs=1, max_tokens=2)["choices"][0]
    prompt_text = httpx.post(server.base_url + "/detokenize", json={"tokens": IDS}).json()
    assert scored["text"] == prompt_text["prompt"]
    assert scored["logprobs"]["tokens"] == full["logprobs"]["tokens"][: len(IDS)]
    assert scored["logprobs"]["token_logprobs"] == full["logprobs"]["token_logprobs"][: len(IDS)]
    assert scored["finish_reason"] == "length"


def test_text_prompt_echo_through_the_openai_client(client):
    out = client.completions.create(
        model=MODEL, prompt="The quick brown fox", echo=True, logprobs=1, max_tokens=0
    )
    choice = out.choices[0]
    assert choice.text == "The quick brown fox"
    assert choice.logprobs.token_logprobs[0] is None
    assert "".join(choice.logprobs.tokens).endswith("The quick brown fox")


def test_prompt_logprobs_field_on_completions_and_chat(server):
    choice = completion(server, prompt=IDS, prompt_logprobs=2, max_tokens=1)["choices"][0]
    entries = choice["prompt_logprobs"]
    assert choice["logprobs"] is None and len(entries) == len(IDS) and entries[0] is None
    for position, entry in enumerate(entries[1:], start=1):
        assert str(IDS[position]) in entry and len(entry) <= 3
        assert {1, 2} <= {lp["rank"] for lp in entry.values()}
        assert all(set(lp) == {"logprob", "rank", "decoded_token"} for lp in entry.values())
    chat = post(
        server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 0, "max_tokens": 1},
    ).json()
    entries = chat["prompt_logprobs"]
    assert len(entries) == chat["usage"]["prompt_tokens"] and entries[0] is None
    assert all(len(entry) == 1 for entry in entries[1:])  # 0 alternatives: the token alone
    plain = completion(server, prompt=IDS, max_tokens=1)["choices"][0]
    assert "prompt_logprobs" not in plain


def test_streamed_echo_with_logprobs_equals_the_full_response(server):
    request = {"prompt": IDS, "echo": True, "logprobs": 1, "max_tokens": 4, "ignore_eos": True}
    full = completion(server, **request)["choices"][0]
    tokens, values, text = [], [], ""
    body = {"model": MODEL, "temperature": 0, "stream": True, **request}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            tokens += choice["logprobs"]["tokens"]
            values += choice["logprobs"]["token_logprobs"]
    assert text == full["text"]
    assert tokens == full["logprobs"]["tokens"]
    assert values == full["logprobs"]["token_logprobs"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ],
)
def test_prompt_logprobs_refusals(server, body, param):
    response = post(server, "/v1/completions", body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_tokenizer_info_serves_lm_evals_remote_tokenizer(server):
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    url = server.base_url + "/v1/completions"
    assert check_remote_tokenizer_support(url)
    remote = RemoteTokenizer(url)
    info = httpx.get(server.base_url + "/tokenizer_info").json()
    assert info["tokenizer_class"] and info["eos_token"] == remote.eos_token
    assert remote.decode(remote.encode("Hello world")) == "Hello world"
    eos = post(server, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos.json()["tokens"] == [remote.eos_token_id]
    messages = [{"role": "user", "content": "Hi"}]
    rendered = remote.apply_chat_template(messages)
    served = post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    assert remote.encode(rendered) == served
