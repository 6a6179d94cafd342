"""A quantized file's expert routers stay dense: a gpt-oss GGUF with Q8_0 attention and router
(dense_type covers every matrix but the experts) and MXFP4 experts runs the native MoE layer in
the fused decoder, its experts in their blocks, the router dequantized at load and packed bf16."""

from __future__ import annotations

import json
import shutil

import torch
from family_checks import assert_quantized_close, prompt_of
from gguf import GGMLQuantizationType as T
from test_fused_decoder import prefill_then_mixed
from test_gpt_oss_gguf import write_gpt_oss_gguf
from test_parity import engine_logits

from cpud import LLM
from cpud.ranks.fused_decoder import FusedDecoder
from cpud.ranks.quant_plan import weight_formats
from hf_reference import hf_logits


def test_quantized_router_runs_dense_with_mxfp4_experts_fused(model_factory, tmp_path, hf_models):
    model_dir = tmp_path / "model"
    shutil.copytree(model_factory("gpt_oss"), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | {"swiglu_limit": 7.0}))
    path = tmp_path / "MXFP4-Q8_0.gguf"
    weights = write_gpt_oss_gguf(model_dir, path, T.MXFP4, T.Q8_0)

    llm = LLM(path, dtype="bfloat16", kernels="native", quantization="auto", weight_cache="off")
    runner = llm.engine.executor.runner
    assert isinstance(runner.decoder, FusedDecoder)
    assert ("Q8_0 router", 2, "dense GEMM (dequantized at load)") in weight_formats(path)
    for layer in runner.model.model.layers:
        assert layer.self_attn.qkv_proj.quant is not None
        assert [s.qtype for s in layer.mlp.experts.quant] == ["MXFP4", "MXFP4"]
        assert layer.mlp.gate.quant is None and layer.mlp.gate.packed is not None
    for fused, per_op in prefill_then_mixed(runner):
        assert torch.isfinite(fused).all()
        assert torch.equal(fused, per_op)
    prompt = prompt_of(40, seed=1)
    want = hf_logits(hf_models(weights), prompt)
    assert_quantized_close(engine_logits(llm, prompt), want, (1.6, 0.06, 0.85))
