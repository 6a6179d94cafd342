"""Streaming that streams: the detokenizer holds back only an incomplete UTF-8 tail (one
U+FFFD of at most 3 bytes), invalid bytes go out at once, and a completion stream from a
random-weight model arrives token by token, not as one event at the end."""

from __future__ import annotations

import json

import httpx
import pytest

from cpud.engine.detokenizer import IncrementalDetokenizer
from cpud.text.tokenizer import Tokenizer

FFFD = "\ufffd"
TEXT = "naïve café 你好 😀🎉 ok"


@pytest.fixture(scope="module")
def tokenizer(model_factory):
    return Tokenizer(model_factory("qwen3"))


def stray_byte(tokenizer: Tokenizer) -> int:
    """A token of one byte that is not a character by itself (nor with an "a" after it)."""
    a = tokenizer.encode("a")
    for token in range(tokenizer.vocab_size):
        if tokenizer.decode([token]) == FFFD and tokenizer.decode([token, *a]) == FFFD + "a":
            return token
    raise AssertionError("the fixture has no lone byte token")


def test_text_trails_the_full_decode_by_one_character_at_most(tokenizer):
    ids = tokenizer.encode(TEXT)
    assert any(FFFD in tokenizer.decode([t]) for t in ids)  # characters are split
    detok = IncrementalDetokenizer(tokenizer)
    for k, token in enumerate(ids, 1):
        detok.add(token)
        full = tokenizer.decode(ids[:k])
        assert detok.text == full or (full.endswith(FFFD) and detok.text == full[:-1])
        assert FFFD not in detok.text
    assert detok.text == TEXT


def test_invalid_bytes_go_out_at_once_as_replacement_characters(tokenizer):
    stray = stray_byte(tokenizer)
    ids = [stray, *tokenizer.encode("a"), stray, stray, *tokenizer.encode("b")]
    detok = IncrementalDetokenizer(tokenizer)
    seen = []
    for token in ids:
        detok.add(token)
        seen.append(detok.text)
    assert seen[1] == FFFD + "a"  # the stray byte did not wait for more
    assert seen[3] == FFFD + "a" + FFFD  # the first of two strays is out, the second held
    assert seen[-1] == FFFD + "a" + FFFD + FFFD + "b"
    detok = IncrementalDetokenizer(tokenizer)
    for _ in range(20):
        detok.add(stray)
    assert detok.text == FFFD * 19


def test_a_stop_string_after_a_held_character_is_found(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=("😀!",))
    found = None
    for token in tokenizer.encode("go 😀! more"):
        found = detok.add(token)
        if found:
            break
    assert found == "😀!" and detok.text == "go "


def stream_texts(server, body: dict) -> list[str]:
    texts = []
    url = server.base_url + "/v1/completions"
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                texts.append(json.loads(line[6:])["choices"][0]["text"])
    return texts


BODY = {"model": "tiny", "prompt": "Hello", "max_tokens": 32, "seed": 7, "ignore_eos": True}


def test_a_completion_stream_arrives_token_by_token(server):
    texts = stream_texts(server, {**BODY, "temperature": 1.0})
    assert sum(1 for t in texts if t) >= 16, texts
    url = server.base_url + "/v1/completions"
    whole = httpx.post(url, json={**BODY, "temperature": 1.0}, timeout=60).json()
    assert "".join(texts) == whole["choices"][0]["text"]


def test_a_stream_of_invalid_bytes_is_not_held_to_the_end(server, tokenizer):
    """Every token a byte that is no character: each goes out as U+FFFD with the next."""
    bias = {str(stray_byte(tokenizer)): 100}
    texts = stream_texts(server, {**BODY, "logit_bias": bias})
    assert sum(1 for t in texts if t) >= 16, texts
    assert "".join(texts) == FFFD * 32
