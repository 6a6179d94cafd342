"""`cpud serve --speculative-config`: the startup log names the setting, /metrics counts the
proposals, and a bad value stops the start with one clear line."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from cpud_server_helpers import metric, start_server

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


@pytest.mark.slow
def test_serve_speculates_and_counts_it(model_factory, tmp_path):
    server = start_server(
        model_factory("qwen3"), tmp_path / "serve.log", "--speculative-config", json.dumps(SPEC)
    )
    try:
        body = {
            "model": "tiny",
            "prompt": "one two three one two three one two three one two three",
            "max_tokens": 48,
            "temperature": 0,
            "ignore_eos": True,
        }
        response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 48
        proposed = metric(server, "cpud_spec_decode_num_draft_tokens_total")
        accepted = metric(server, "cpud_spec_decode_num_accepted_tokens_total")
        assert proposed > 0 and 0 <= accepted <= proposed
        assert metric(server, "cpud_spec_decode_num_drafts_total") > 0
        assert (
            metric(server, 'cpud_spec_decode_num_accepted_tokens_per_pos_total{position="0"}') >= 0
        )
        assert metric(server, "cpud_spec_decode_mean_accepted_length") >= 1.0
    finally:
        server.stop()
    assert "speculative decoding: ngram, 3 proposed tokens per step" in server.log()


def test_serve_refuses_a_bad_speculative_config(model_factory):
    bad = '{"method": "ngram", "num_speculative_tokens": 0}'
    cmd = [sys.executable, "-m", "cpud.cli", "serve", "--model", str(model_factory("qwen3"))]
    done = subprocess.run(
        [*cmd, "--speculative-config", bad], capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "--speculative-config: num_speculative_tokens must be a whole number" in done.stderr
    assert "Traceback" not in done.stderr
