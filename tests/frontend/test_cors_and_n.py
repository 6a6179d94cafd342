"""Opt-in browser access (--allowed-origins, also behind an API key) and the KV bound of a
request's n sequences, on a server with both a listed origin and a small KV cache."""

from __future__ import annotations

import httpx
import pytest

from cpud.cli import main
from cpud.settings.cors_policy import word_list
from cpud_server_helpers import start_server

KEY = "sk-cors-test"
UI = "http://ui.example:3000"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def small(model_factory, tmp_path_factory):
    srv = start_server(
        model_factory("qwen3"),
        tmp_path_factory.mktemp("cors") / "serve.log",
        "--max-model-len",
        "256",
        "--kv-cache-space",
        "0.001",
        "--allowed-origins",
        f'["{UI}"]',
        env={"CPUD_API_KEY": KEY},
    )
    yield srv
    srv.stop()


def preflight(srv, origin: str) -> httpx.Response:
    return httpx.options(
        srv.base_url + "/v1/chat/completions",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )


def test_listed_origin_gets_preflight_and_headers(small):
    answer = preflight(small, UI)  # no API key: a preflight carries none
    assert answer.status_code == 200, answer.text
    assert answer.headers["access-control-allow-origin"] == UI
    assert "POST" in answer.headers["access-control-allow-methods"]
    call = httpx.post(
        small.base_url + "/v1/completions", json=PROMPT, headers={**AUTH, "Origin": UI}
    )
    assert call.status_code == 200, call.text
    assert call.headers["access-control-allow-origin"] == UI
    assert "x-request-id" in call.headers["access-control-expose-headers"].lower()
    # The key is still needed for the call itself.
    assert httpx.post(small.base_url + "/v1/completions", json=PROMPT).status_code == 401


def test_other_origins_get_no_cors(small):
    answer = preflight(small, "http://evil.example")
    assert answer.status_code == 400
    assert "access-control-allow-origin" not in answer.headers
    call = httpx.post(
        small.base_url + "/v1/completions",
        json=PROMPT,
        headers={**AUTH, "Origin": "http://evil.example"},
    )
    assert "access-control-allow-origin" not in call.headers


def test_n_sequences_must_fit_the_kv_cache_together(small):
    fits = httpx.post(
        small.base_url + "/v1/completions",
        json={**PROMPT, "n": 8, "temperature": 1.0},
        headers=AUTH,
        timeout=60,
    )
    assert fits.status_code == 200, fits.text
    assert len(fits.json()["choices"]) == 8
    # Up to the whole context each: more blocks than the cache holds.
    too_many = httpx.post(
        small.base_url + "/v1/completions",
        json={**PROMPT, "n": 64, "max_tokens": None},
        headers=AUTH,
        timeout=60,
    )
    assert too_many.status_code == 400, too_many.text
    error = too_many.json()["error"]
    assert error["param"] == "n" and "KV blocks" in error["message"]
    assert httpx.get(small.base_url + "/health").status_code == 200


def test_origin_lists_as_vllm_spells_them():
    assert word_list(['["http://a:1", "https://b"]']) == ("http://a:1", "https://b")
    assert word_list(["http://a:1,https://b", "*"]) == ("http://a:1", "https://b", "*")
    # the environment variable's words, split on spaces and commas
    assert word_list(['["http://a:1"', '"https://b"]']) == ("http://a:1", "https://b")


@pytest.mark.parametrize(
    "flags",
    [
        ["--allowed-origins", "http://ui.example/"],
        ["--allowed-origins", "ui.example"],
        ["--allowed-origins", "*", "--allowed-methods", "PO ST"],
    ],
)
def test_bad_origin_exits_2(flags, capsys):
    assert main(["serve", *flags]) == 2
    assert "--allowed-" in capsys.readouterr().err
