"""The engine on the native kernels: every ISA tier gives transformers' greedy tokens, the
weights are held once (packed), and what runs is visible in `cpud doctor --json`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cpud import LLM, native
from cpud.ranks.layers.linear import PackableLinear

pytestmark = pytest.mark.skipif(not native.available(), reason="native library not built")


def generate_json(model_dir, *extra: str, env: dict | None = None) -> list[list[int]]:
    cmd = [sys.executable, "-m", "cpud.cli", "generate", "--model", str(model_dir)]
    cmd += ["--max-tokens", "12", "--ignore-eos", "--json", *extra, "Hello there", "naïve 你好"]
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})}
    )
    assert result.returncode == 0, result.stderr
    return [row["token_ids"] for row in json.loads(result.stdout)["outputs"]]


@pytest.mark.parametrize("isa", native.supported_isas())
def test_every_isa_tier_generates_the_reference_tokens(isa, model_factory):
    model_dir = model_factory("qwen3")
    reference = generate_json(model_dir, "--dtype", "float32", "--kernels", "torch")
    tier = generate_json(model_dir, "--dtype", "float32", env={"CPUD_ISA": isa})
    assert tier == reference


def test_bf16_weights_are_packed_once(model_factory):
    llm = LLM(model_factory("qwen3"), dtype="bfloat16", kernels="native")
    model = llm.engine.executor.runner.model
    linears = [m for m in model.modules() if isinstance(m, PackableLinear)]
    assert linears and all(m.packed is not None and m.weight is None for m in linears)
    # The tied embedding reads rows from the head's packed copy instead of its own table.
    assert model.model.embed_tokens.weight is None
    assert model.model.embed_tokens.packed is model.lm_head.packed
    out = llm.generate([[5, 6, 7]], None)[0]
    assert out.outputs[0].token_ids


def test_fp32_models_keep_torch_matmuls(model_factory):
    llm = LLM(model_factory("llama"), dtype="float32", kernels="native")
    assert llm.engine.executor.runner.ops.name == "native"
    model = llm.engine.executor.runner.model
    assert all(m.packed is None for m in model.modules() if isinstance(m, PackableLinear))


def test_doctor_reports_isa_and_native(tmp_path):
    lowered = native.supported_isas()[-2]  # a tier below the best this CPU runs
    result = subprocess.run(
        [sys.executable, "-m", "cpud.cli", "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "CPUD_ISA": lowered},
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["native kernels"]["value"]["available"] is True
    assert checks["native kernels"]["value"]["isa"] == lowered
    assert checks["native kernels"]["value"]["detected_isa"] == native.detected_isa()
    assert "lowers" in checks["native kernels"]["advice"]
