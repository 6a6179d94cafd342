"""gpt-oss Hugging Face checkpoints with MXFP4 experts, as OpenAI publishes them
(quantization_config mxfp4; mlp.experts.gate_up_proj_blocks [E, 2I, H/32, 16] and _scales
[E, 2I, H/32] with gate and up rows interleaved, down_proj_blocks [E, H, I/32, 16]; biases,
attention and router in bf16): cpud reads each _blocks / _scales pair as one tensor of its
values, equal to the same checkpoint with those values stored plainly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from family_checks import assert_close_fp32, assert_quantized_close, greedy, prompt_of
from gguf import GGMLQuantizationType as T
from safetensors.numpy import load_file, save_file
from test_parity import engine_logits

from cpud import LLM
from cpud.native.mxfp4 import to_hf_blocks
from cpud.ranks.hf_mxfp4 import Mxfp4Source, dequantize
from hf_reference import hf_logits

ARCH = "gpt_oss"


def mxfp4_checkpoint(model_dir: Path, out: Path) -> tuple[Path, Path]:
    """(model_dir with MXFP4 experts, model_dir with those experts' values stored plainly)."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    quantized, plain = {}, {}
    for name, values in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            quantized[name] = plain[name] = values
            continue
        rows = np.ascontiguousarray(values.transpose(0, 2, 1), dtype=np.float32)  # [E, out, in]
        encoded = gguf.quants.quantize(rows, T.MXFP4)
        blocks, scales = to_hf_blocks(encoded)
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
        dense = gguf.quants.dequantize(encoded, T.MXFP4).reshape(rows.shape)
        plain[name] = np.ascontiguousarray(dense.transpose(0, 2, 1))
    dirs = []
    for kind, weights in (("mxfp4", quantized), ("plain", plain)):
        target = out / kind
        shutil.copytree(model_dir, target)
        save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
        if kind == "mxfp4":
            raw = json.loads((target / "config.json").read_text())
            raw["quantization_config"] = {
                "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
                "quant_method": "mxfp4",
            }
            (target / "config.json").write_text(json.dumps(raw))
        dirs.append(target)
    return dirs[0], dirs[1]


@pytest.fixture(scope="module")
def checkpoints(model_factory, tmp_path_factory):
    return mxfp4_checkpoint(model_factory(ARCH), tmp_path_factory.mktemp("gpt-oss-mxfp4"))


def test_mxfp4_values_equal_gguf_s():
    """Hugging Face's MXFP4 layout read as values: ggml's MXFP4 values of the same blocks."""
    rows = np.random.default_rng(0).standard_normal((3, 5, 64)).astype(np.float32) * 3
    encoded = gguf.quants.quantize(rows, T.MXFP4)
    blocks, scales = to_hf_blocks(encoded)
    want = gguf.quants.dequantize(encoded, T.MXFP4).reshape(rows.shape)
    np.testing.assert_array_equal(dequantize(blocks, scales), want)
    source = Mxfp4Source("w", torch.from_numpy(blocks), torch.from_numpy(scales))
    assert source.get_shape() == [3, 5, 64]
    torch.testing.assert_close(source[1:3], torch.from_numpy(want[1:3]))


def test_mxfp4_scale_0xff_is_refused():
    blocks, scales = np.zeros((2, 1, 16), np.uint8), np.full((2, 1), 0xFF, np.uint8)
    source = Mxfp4Source("experts", torch.from_numpy(blocks), torch.from_numpy(scales))
    with pytest.raises(ValueError, match="0xFF"):
        source[:]


@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_mxfp4_checkpoint_equals_its_values(kernels, checkpoints, hf_models):
    """Read dense (torch kernels, or --quantization none): the plain copy's logits."""
    mxfp4, plain = checkpoints
    prompt = prompt_of(50, seed=7)
    want = hf_logits(hf_models(plain), prompt)
    llm = LLM(mxfp4, dtype="float32", kernels=kernels, quantization="none")
    assert_close_fp32(engine_logits(llm, prompt), want)


def test_mxfp4_checkpoint_greedy_bf16(checkpoints):
    """bf16 (experts packed for the native GEMM, fused): the same tokens as the plain copy."""
    mxfp4, plain = checkpoints
    prompts = [prompt_of(n, seed=n) for n in (5, 33)]
    got = LLM(mxfp4, dtype="bfloat16", quantization="none").generate(prompts, greedy())
    want = LLM(plain, dtype="bfloat16").generate(prompts, greedy())
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_mxfp4_experts_stay_in_their_blocks(dtype, checkpoints, hf_models):
    """Native kernels: the MXFP4 expert stacks are packed from their blocks (no dense copy)
    and run on the int8 kernels, within the quantized GEMM's bounds of the values."""
    mxfp4, plain = checkpoints
    llm = LLM(mxfp4, dtype=dtype, kernels="native", weight_cache="off")
    experts = [layer.mlp.experts for layer in llm.engine.executor.runner.model.model.layers]
    assert all(e.quant is not None and e.quant[0].qtype == "MXFP4" for e in experts)
    assert all(e.gate_up_proj is None and e.down_proj is None for e in experts)
    prompt = prompt_of(40, seed=1)
    want = hf_logits(hf_models(plain), prompt)
    assert_quantized_close(engine_logits(llm, prompt), want, (1.6, 0.06, 0.85))
