"""The memory plan and doctor count MXFP4 expert stacks (gpt-oss) at the size the ranks keep
them in: a Hugging Face checkpoint's `_blocks` + `_scales` as stored, a GGUF file's MXFP4
stacks as in the file; the plan's weight bytes against what a loaded rank holds."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_gpt_oss_gguf import write_gpt_oss_gguf
from test_gpt_oss_mxfp4 import mxfp4_checkpoint

from cpud.model.hf_mxfp4_experts import mxfp4_expert_stacks
from cpud.model.load import load_model_config
from cpud.placement.memory_plan import quantized_weight_bytes
from cpud.ranks.gguf_experts import expert_bytes
from cpud.ranks.layers.linear import PackableLinear
from cpud.ranks.model_runner import ModelRunner, RunnerConfig
from cpud.ranks.parallel import SingleRank
from cpud.ranks.quant_linear import quant_bytes
from cpud.ranks.quant_plan import weight_formats


def _held_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight a loaded model holds: parameters, packed bf16 linears, packed
    quantized linears and expert stacks."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    packed = sum(
        m.packed.data.numel() * m.packed.data.element_size()
        for m in model.modules()
        if isinstance(m, PackableLinear) and m.packed is not None
    )
    return params + packed + quant_bytes(model)


def _loaded(path) -> torch.nn.Module:
    cfg = load_model_config(path)
    config = RunnerConfig(path, torch.bfloat16, 256, 16, 16, kernels="native", weight_cache=None)
    return ModelRunner(config, cfg, SingleRank()).model


@pytest.fixture(scope="module")
def hf_mxfp4(model_factory, tmp_path_factory):
    return mxfp4_checkpoint(model_factory("gpt_oss"), tmp_path_factory.mktemp("mxfp4-plan"))[0]


def test_hf_mxfp4_experts_planned_at_their_packed_size(hf_mxfp4):
    """The experts count as their blocks and scales (17 bytes per 32 weights, what the rank
    packs exactly), not as bf16 (3.8 times that): the whole plan within 5 % of the weights the
    loaded rank holds (the rest is the tiny model's padding of packed linears)."""
    cfg = load_model_config(hf_mxfp4)
    stacks = mxfp4_expert_stacks(hf_mxfp4)
    assert len(stacks) == 2 * cfg.num_layers
    model = _loaded(hf_mxfp4)
    packed = expert_bytes(model)
    assert packed == sum(s.nbytes for s in stacks)
    planned = quantized_weight_bytes(cfg, "bfloat16", 1, hf_mxfp4, "auto")
    dense = quantized_weight_bytes(cfg, "bfloat16", 1, hf_mxfp4, "none")
    assert dense - planned == sum(s.values for s in stacks) * 2 - packed
    held = _held_bytes(model)
    assert abs(planned / held - 1) < 0.05, (planned, held)
    halves = [quantized_weight_bytes(cfg, "bfloat16", 2, hf_mxfp4, q) for q in ("auto", "none")]
    assert halves[1] - halves[0] == (dense - planned) // 2  # each rank packs half the rows


def test_doctor_lists_hf_mxfp4_expert_stacks(hf_mxfp4):
    cfg = load_model_config(hf_mxfp4)
    rows = {fmt: (count, kernel) for fmt, count, kernel in weight_formats(hf_mxfp4, "auto", cfg)}
    assert rows["MXFP4 expert stacks"][0] == 2 * cfg.num_layers
    assert "int8 dot" in rows["MXFP4 expert stacks"][1]
    rows = {fmt: kernel for fmt, _, kernel in weight_formats(hf_mxfp4, "none", cfg)}
    assert rows["MXFP4 expert stacks"] == "dense GEMM (dequantized at load)"


def test_gguf_mxfp4_experts_planned_at_file_size(model_factory, tmp_path):
    path = tmp_path / "gpt-oss-mxfp4.gguf"
    write_gpt_oss_gguf(model_factory("gpt_oss"), path, T.MXFP4, T.F32)
    cfg = load_model_config(path)
    planned = quantized_weight_bytes(cfg, "bfloat16", 1, path, "auto")
    held = _held_bytes(_loaded(path))
    assert abs(planned / held - 1) < 0.05, (planned, held)
