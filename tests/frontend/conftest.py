"""A real `cpud serve` process on loopback, started once for the HTTP tests."""

from __future__ import annotations

import pytest

from cpud_server_helpers import start_server


@pytest.fixture(scope="session")
def server(model_factory, tmp_path_factory):
    srv = start_server(
        model_factory("qwen3"),
        tmp_path_factory.mktemp("server") / "serve.log",
        "--max-model-len",
        "256",
        # A request some test leaves open is waited for at the session's end up to this long
        # (inside stop()'s 30 s), not the default 30 s.
        "--drain-timeout",
        "5",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
