"""gpt-oss GGUF files (`gpt-oss`) written the way llama.cpp's converter writes them (GptOssModel:
q/k/v unpermuted, the router as ffn_gate_inp with its bias, attn_sinks, post_attention_norm,
each expert stack split into ffn_gate_exps / ffn_up_exps [E, I, H] and ffn_down_exps [E, H, I]
with their biases [E, rows] in F32; experts in F32, Q8_0 or MXFP4), against transformers on
the file's own weights (the experts as the file holds them, dequantized); quantized experts
stay in their blocks on the native kernels. llama.cpp hard-codes the experts' swiglu_limit
7.0, so the files are written from the fixture with that limit."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from family_checks import assert_close_fp32, assert_quantized_close, check_tp2, greedy, prompt_of
from gguf import GGMLQuantizationType as T
from gguf_vocab import add_tokenizer_metadata
from gguf_writer import _set_parameters, encode
from safetensors.numpy import load_file, save_file
from test_parity import engine_logits
from tokenizers import Regex, pre_tokenizers

from cpud import LLM
from cpud.fixtures.archs.gpt_oss import llama_cpp_expert_parts, llama_cpp_name
from cpud.model.load import load_model_config
from cpud.ranks.fused_decoder import FusedDecoder
from cpud.ranks.layers.rotary import cos_sin_table
from cpud.text.gguf_tokenizer import PRE_SPLITS, read_vocab
from hf_reference import hf_greedy, hf_logits

ARCH = "gpt_oss"


def write_gpt_oss_gguf(model_dir: Path, path: Path, expert_type: T, dense_type: T) -> Path:
    """The fixture as GptOssModel converts it; returns a copy of model_dir whose checkpoint holds
    the weights as the file does (dequantized), in the Hugging Face layout."""
    config = json.loads((model_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    _set_parameters(writer, "gpt-oss", config, gguf.LlamaFileType.GUESSED)
    add_tokenizer_metadata(writer, model_dir, kind="gpt2")
    tensors = load_file(str(model_dir / "model.safetensors"))
    as_file = {}
    for hf, values in tensors.items():
        values = values.astype(np.float32)
        parts = llama_cpp_expert_parts(hf)
        if parts is None:
            qtype = dense_type if values.ndim == 2 else T.F32
            encoded = encode(values, qtype)
            writer.add_tensor(llama_cpp_name(hf), encoded, raw_dtype=qtype)
            as_file[hf] = gguf.quants.dequantize(encoded, qtype).reshape(values.shape)
            continue
        if hf.endswith("_bias"):  # F32 [E, rows]
            for name, start in parts:
                part = values if start is None else values[:, start::2]
                writer.add_tensor(name, np.ascontiguousarray(part), raw_dtype=T.F32)
            as_file[hf] = values
            continue
        rows = values.transpose(0, 2, 1)  # [E, out, in]
        back = {}
        for name, start in parts:
            part = rows if start is None else rows[:, start::2]
            encoded = np.stack([encode(np.ascontiguousarray(w), expert_type) for w in part])
            writer.add_tensor(name, encoded, raw_dtype=expert_type)
            back[start] = np.stack(
                [gguf.quants.dequantize(w, expert_type).reshape(part.shape[1:]) for w in encoded]
            )
        if None in back:  # down_proj
            as_file[hf] = back[None].transpose(0, 2, 1)
        else:
            joined = np.empty(rows.shape, dtype=np.float32)
            joined[:, ::2], joined[:, 1::2] = back[0], back[1]
            as_file[hf] = joined.transpose(0, 2, 1)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = path.with_suffix(".hf")
    shutil.copytree(model_dir, out)
    tensors = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in as_file.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def limit7_dir(model_factory, tmp_path_factory):
    """The fixture with llama.cpp's swiglu_limit 7.0."""
    out = tmp_path_factory.mktemp("gpt-oss-limit7") / "model"
    shutil.copytree(model_factory(ARCH), out)
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(raw | {"swiglu_limit": 7.0}))
    return out


@pytest.fixture(scope="module")
def gguf_pair(limit7_dir, tmp_path_factory):
    """(expert type, dense type) -> (GGUF file, its weights as a Hugging Face directory)."""
    root = tmp_path_factory.mktemp("gpt-oss-gguf")
    made = {}

    def get(expert_type: T, dense_type: T = T.F32) -> tuple[Path, Path]:
        key = (expert_type, dense_type)
        if key not in made:
            path = root / f"{expert_type.name}-{dense_type.name}.gguf"
            made[key] = path, write_gpt_oss_gguf(limit7_dir, path, expert_type, dense_type)
        return made[key]

    return get


def test_gguf_config_equals_the_checkpoints(gguf_pair, limit7_dir):
    path, _ = gguf_pair(T.F32)
    ours, want = load_model_config(path), load_model_config(limit7_dir)
    assert ours.family == want.family == ARCH
    assert replace(ours.recipe, ropes=()) == replace(want.recipe, ropes=())
    # YaRN's attention factor explicit in one, derived in the other: the same table
    (ours_rope,), (want_rope,) = ours.recipe.ropes, want.recipe.ropes
    torch.testing.assert_close(
        cos_sin_table(16, 256, ours_rope.theta, ours_rope.scaling),
        cos_sin_table(16, 256, want_rope.theta, want_rope.scaling),
    )
    assert ours.moe == want.moe
    assert (ours.num_experts, ours.num_experts_per_tok, ours.moe_intermediate_size) == (
        want.num_experts,
        want.num_experts_per_tok,
        want.moe_intermediate_size,
    )


@pytest.mark.parametrize("expert_type", [T.F32, T.Q8_0, T.MXFP4])
def test_gguf_logits_match_transformers(expert_type, gguf_pair, hf_models):
    path, weights = gguf_pair(expert_type)
    prompt = prompt_of(50, seed=7)
    want = hf_logits(hf_models(weights), prompt)
    assert_close_fp32(engine_logits(LLM(path, dtype="float32", kernels="torch"), prompt), want)


@pytest.mark.slow
def test_gguf_greedy_tokens_match_transformers(gguf_pair, hf_models):
    path, weights = gguf_pair(T.F32)
    hf = hf_models(weights)
    prompts = [prompt_of(n, seed=n) for n in (5, 33)]
    outputs = LLM(path, dtype="float32", max_num_batched_tokens=16).generate(prompts, greedy())
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(
            hf, prompt, len(output.outputs[0].token_ids)
        )


def test_gguf_tp2_logits_equal_tp1(gguf_pair):
    check_tp2(gguf_pair(T.F32)[0])


def test_gguf_bf16_logits_close(gguf_pair, hf_models):
    path, weights = gguf_pair(T.F32)
    prompt = prompt_of(45, seed=3)
    want = hf_logits(hf_models(weights), prompt)
    got = engine_logits(LLM(path, dtype="bfloat16"), prompt)
    error = (got - want).abs() / want.std()
    assert float(error.mean()) < 0.1, float(error.mean())
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.8
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("expert_type", [T.MXFP4, T.Q8_0])
def test_gguf_quantized_experts_stay_in_their_blocks(expert_type, gguf_pair, hf_models):
    """bf16 on the native kernels: the expert stacks run in their blocks (int8 activations)
    through the fused decoder. Against transformers in fp32 on the file's weights the mean
    error stays small; single positions jump where bf16 or int8 rounding flips a near-tie of
    two experts' router scores (transformers' own bf16 reaches 0.9σ on these weights)."""
    path, weights = gguf_pair(expert_type)
    llm = LLM(path, dtype="bfloat16", kernels="native", weight_cache="off")
    runner = llm.engine.executor.runner
    assert isinstance(runner.decoder, FusedDecoder)
    experts = [layer.mlp.experts for layer in runner.model.model.layers]
    assert all(e.quant is not None and e.quant[0].qtype == expert_type.name for e in experts)
    prompt = prompt_of(40, seed=1)
    want = hf_logits(hf_models(weights), prompt)
    assert_quantized_close(engine_logits(llm, prompt), want, (1.6, 0.06, 0.85))


def test_gguf_harmony_ends_of_generation(gguf_pair):
    """<|return|> and <|call|> end generation, <|end|> (closing the analysis message) does not,
    as llama.cpp reads an o200k_harmony vocabulary."""
    vocab = read_vocab(gguf_pair(T.F32)[0])
    ends = {vocab.tokens[i] for i in vocab.eog_ids}
    assert {"<|return|>", "<|call|>", "<|endoftext|>"} <= ends
    assert "<|end|>" not in ends


def test_o200k_pre_tokenizer_splits():
    """llama.cpp's `gpt-4o` split (o200k): letters with their contraction, runs of 1-3 digits,
    a lone space before digits."""
    split = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_SPLITS["gpt-4o"]]
    )
    pieces = [p for p, _ in split.pre_tokenize_str("Hello World's 12345 don't\n\nx")]
    assert pieces == ["Hello", " World's", " ", "123", "45", " don't", "\n\n", "x"]
