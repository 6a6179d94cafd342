"""One `cpud serve` of the default model (SmolLM2-135M-Instruct), shared by the structured
output, tool calling and /v1/responses tests: real output quality, real grammar enforcement."""

from __future__ import annotations

import pytest

from cpud.model.default_model import default_model_path
from cpud_server_helpers import start_server


@pytest.fixture(scope="session")
def smol(tmp_path_factory):
    srv = start_server(
        default_model_path(),
        tmp_path_factory.mktemp("smol") / "serve.log",
        "--max-model-len",
        "2048",
        "--kv-cache-space",
        "0.25",
        "--no-kv-cache-pretouch",
        "--drain-timeout",
        "3",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def smol_client(smol):
    from openai import OpenAI

    return OpenAI(base_url=smol.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def compiler():
    """(the default model's tokenizer, a grammar compiler for it)"""
    from cpud.structured.compiler import GrammarCompiler
    from cpud.text.tokenizer import Tokenizer

    tokenizer = Tokenizer(default_model_path())
    return tokenizer, GrammarCompiler(tokenizer)
