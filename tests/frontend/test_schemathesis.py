"""schemathesis fuzzes every operation of /openapi.json, positive and negative cases:
no input may produce a 5xx."""

from __future__ import annotations

import shutil
import subprocess

import httpx


def test_no_server_errors_under_fuzzing(server):
    exe = shutil.which("schemathesis") or shutil.which("st")
    assert exe, "schemathesis is a test dependency: pip install -e .[test]"
    result = subprocess.run(
        [
            exe,
            "run",
            server.base_url + "/openapi.json",
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
    assert httpx.get(server.base_url + "/health").status_code == 200
