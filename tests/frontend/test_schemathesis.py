"""schemathesis fuzzes every operation of /openapi.json, positive and negative cases:
no input may produce a 5xx."""

from __future__ import annotations

import shutil
import subprocess

import httpx
import pytest

from cpud_server_helpers import start_server


@pytest.fixture(scope="module")
def fuzzed(model_factory, tmp_path_factory):
    """A server of its own with a short context: the fuzzer's prompts are ~10 tokens, and
    every request that reaches the engine generates up to the context's end (n up to 128
    choices), which at the shared server's 256 tokens was most of this module's time."""
    srv = start_server(
        model_factory("qwen3"),
        tmp_path_factory.mktemp("fuzzed") / "serve.log",
        "--max-model-len",
        "64",
        "--drain-timeout",
        "5",
    )
    yield srv
    srv.stop()


def test_no_server_errors_under_fuzzing(fuzzed):
    exe = shutil.which("schemathesis") or shutil.which("st")
    assert exe, "schemathesis is a test dependency: pip install -e .[test]"
    result = subprocess.run(
        [
            exe,
            "run",
            fuzzed.base_url + "/openapi.json",
            "--checks",
            "not_a_server_error",
            "--mode",
            "all",
            "--max-examples",
            "4",
            "--seed",
            "1",
            "--request-timeout",
            "30",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:]
    assert "passed" in result.stdout
    # The daemon still serves afterwards.
    assert httpx.get(fuzzed.base_url + "/health").status_code == 200
