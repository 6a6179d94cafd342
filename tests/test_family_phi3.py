"""Phi-3 / Phi-4-mini (ranks/models/families/phi3.py) against transformers: fused qkv_proj and
gate_up_proj split per rank, partial rotary, LongRoPE across the original length (32 of 1024
positions in the fixture), family_checks' checks against transformers, and GGUF files (F16,
Q8_0, Q4_K_M) against transformers' GGUF loader on the same files."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from family_checks import (
    DTYPES,
    QTYPES,
    TransformersChecks,
    assert_close_fp32,
    assert_quantized_close,
    gguf_files,
    greedy,
    needs_native,
    parity_prompt,
    prefill_logits,
    runner,
)
from gguf import GGMLQuantizationType as T
from safetensors import safe_open
from test_tp_sharding import ThreadGroupHub, ThreadRank

from cpud import LLM
from cpud.fixtures.archs.phi3 import ORIGINAL_LENGTH, TINY, factors
from cpud.model.gguf_model import read_gguf_model
from cpud.model.load import load_model_config
from cpud.ranks.layers.rotary import cos_sin_table
from cpud.ranks.loader import load_weights
from cpud.ranks.models.build import build_model
from cpud.settings.errors import ConfigError
from hf_reference import hf_greedy, hf_logits

ARCH = "phi3"


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(ARCH)


@torch.inference_mode()
def hf_logits_token_by_token(model, prompt: list[int], first: int) -> torch.Tensor:
    """transformers with its cache: `first` tokens in one call, then one token per call, each
    call's RoPE set chosen by its own position (what Phi-3's dynamic LongRoPE does per step)."""
    from transformers import DynamicCache

    out = model(input_ids=torch.tensor([prompt[:first]]), cache=DynamicCache(config=model.config))
    logits = [out.logits[0]]
    for token in prompt[first:]:
        out = model(input_ids=torch.tensor([[token]]), cache=out.cache, use_cache=True)
        logits.append(out.logits[0])
    return torch.cat(logits).float()


@torch.inference_mode()
def hf_greedy_by_position(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """hf_greedy with at most the original length in transformers' first call and one token
    per call after it, so that each position's factors are its own (one forward over a longer
    prompt turns all of it by the long factors)."""
    from transformers import DynamicCache

    first = min(len(prompt), ORIGINAL_LENGTH)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([prompt[:first]]), cache=cache, use_cache=True)
    for token in prompt[first:]:
        out = model(input_ids=torch.tensor([[token]]), cache=out.cache, use_cache=True)
    generated = [int(out.logits[0, -1].argmax())]
    while len(generated) < max_new_tokens:
        out = model(input_ids=torch.tensor([[generated[-1]]]), cache=out.cache, use_cache=True)
        generated.append(int(out.logits[0, -1].argmax()))
    return generated


class TestAgainstTransformers(TransformersChecks):
    """Logit prompts below the original length (all short factors: one transformers forward
    agrees); greedy prompts below and across it (generation crossing it) and the prefix cache's
    shared 50 tokens (3 cached blocks) across it, against hf_greedy_by_position."""

    prompt = staticmethod(parity_prompt)
    fp32_length = bf16_length = ORIGINAL_LENGTH - 2
    greedy_lengths = (5, 24, 45)  # the chunked setting prefills the 45 in 2 chunks across 32
    new_tokens = 16
    prefix_shared = 50

    def reference_greedy(self, model, prompt: list[int], new_tokens: int) -> list[int]:
        return hf_greedy_by_position(model, prompt, new_tokens)

    def test_the_reference_is_hf_greedy_below_the_original_length(
        self, greedy_reference, model_dir, hf_models
    ):
        prompts, expected = greedy_reference
        model = hf_models(model_dir)
        assert expected[:2] == [hf_greedy(model, p, self.new_tokens) for p in prompts[:2]]


def test_config_and_recipe(model_dir):
    cfg = load_model_config(model_dir)
    assert (cfg.family, cfg.architecture) == ("phi3", "Phi3ForCausalLM")
    assert cfg.recipe.rotary_dim == 12 and cfg.head_dim == 16  # 0.75 of each head rotates
    scaling = cfg.rope_scaling
    assert scaling["rope_type"] == "longrope" and scaling["factor"] == 1024 / 32
    assert scaling["original_max_position_embeddings"] == ORIGINAL_LENGTH
    assert cfg.sliding_window is None and not cfg.qkv_bias and not cfg.tie_word_embeddings
    assert "longrope scaling" in cfg.recipe.describe()


def test_cos_sin_table_switches_to_long_factors_at_the_original_length(model_dir):
    """Positions below original_max_position_embeddings turn by the short factors, the rest by
    the long ones; both scaled by sqrt(1 + ln(1024 / 32) / ln 32) = sqrt(2)."""
    scaling = load_model_config(model_dir).rope_scaling
    table = cos_sin_table(12, 100, 10000.0, scaling)
    positions = torch.arange(100, dtype=torch.float32)[:, None]
    base = 10000.0 ** (torch.arange(0, 12, 2).float() / 12)
    short, long = (torch.tensor(scaling[k]) for k in ("short_factor", "long_factor"))
    assert not torch.equal(short, long)
    for rows, chosen in ((slice(0, 32), short), (slice(32, 100), long)):
        angles = positions[rows] / (chosen * base)
        want = torch.cat((angles.cos(), angles.sin()), -1) * math.sqrt(2)
        torch.testing.assert_close(table[rows], want)


def test_a_prompt_past_the_original_length(model_dir, hf_models):
    """cpud's logits over a 70-token prompt equal transformers run token by token with its
    cache past the original length (each position keeps its own factors). One transformers
    forward over the whole prompt rotates every position by the long factors (its longrope
    picks one set per call, by the largest position): the positions below 32 then differ from
    cpud's, which equal transformers' forward over those 32 tokens alone."""
    model = hf_models(model_dir)
    prompt = parity_prompt(70, seed=2)
    got = prefill_logits(runner(model_dir), prompt)
    assert_close_fp32(got, hf_logits_token_by_token(model, prompt, ORIGINAL_LENGTH))
    assert_close_fp32(got[:ORIGINAL_LENGTH], hf_logits(model, prompt[:ORIGINAL_LENGTH]))
    whole = hf_logits(model, prompt)
    assert float((got[:ORIGINAL_LENGTH] - whole[:ORIGINAL_LENGTH]).abs().max()) > whole.std()


def test_chunked_prefill_equals_one_step(model_dir):
    """Chunks of 16 and 23 tokens, one crossing the original length, each on a fresh runner."""
    prompt = parity_prompt(70, seed=4)
    whole = prefill_logits(runner(model_dir), prompt)
    for chunk in (16, 23):
        assert_close_fp32(prefill_logits(runner(model_dir), prompt, chunk), whole)


def test_each_rank_reads_its_rows_of_the_fused_tensors(model_dir):
    """At TP=2 rank r holds q rows r*32.., k and v rows r*16.. of qkv_proj (q 64, k 32, v 32
    rows in the checkpoint) and gate, up rows r*64.. of gate_up_proj (gate 128, up 128)."""
    cfg = load_model_config(model_dir)
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        qkv = f.get_tensor("model.layers.1.self_attn.qkv_proj.weight")
        gate_up = f.get_tensor("model.layers.1.mlp.gate_up_proj.weight")
    q, k, v = qkv.split([64, 32, 32])
    gate, up = gate_up.split([128, 128])
    hub = ThreadGroupHub(2)
    for rank in range(2):
        model = build_model(cfg, 64, torch.float32, ThreadRank(hub, rank))
        load_weights(model, model_dir)
        layer = model.model.layers[1]
        want_qkv = torch.cat([q.chunk(2)[rank], k.chunk(2)[rank], v.chunk(2)[rank]])
        assert torch.equal(layer.self_attn.qkv_proj.weight, want_qkv)
        want_gate_up = torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]])
        assert torch.equal(layer.mlp.gate_up_proj.weight, want_gate_up)


def test_sliding_window_as_transformers(model_dir, hf_models, tmp_path):
    """sliding_window (Phi-3-mini: 2047) limits attention to that many tokens, self included,
    as transformers' Phi3 masks it."""
    windowed = tmp_path / "phi3-window"
    shutil.copytree(model_dir, windowed)
    config = json.loads((windowed / "config.json").read_text())
    (windowed / "config.json").write_text(json.dumps(config | {"sliding_window": 20}))
    assert load_model_config(windowed).recipe.windows == (20, 20)
    prompt = parity_prompt(28, seed=8)
    want = hf_logits(hf_models(windowed), prompt)
    assert_close_fp32(prefill_logits(runner(windowed), prompt), want)
    assert float((want - hf_logits(hf_models(model_dir), prompt)).abs().max()) > want.std()


def test_su_is_longrope_and_bad_factors_are_refused(model_dir, tmp_path):
    config = json.loads((model_dir / "config.json").read_text())
    short, long = factors(TINY)

    def load(**changes) -> object:
        folder = tmp_path / f"c{len(list(tmp_path.iterdir()))}"
        shutil.copytree(model_dir, folder)
        (folder / "config.json").write_text(json.dumps(config | changes))
        return load_model_config(folder)

    old = load(rope_scaling={"type": "su", "short_factor": short, "long_factor": long})
    assert old.rope_scaling == load_model_config(model_dir).rope_scaling | {"type": "su"}
    with pytest.raises(ConfigError, match=r"rope_scaling.long_factor must be a list of 6 numbers"):
        load(rope_scaling={"type": "longrope", "short_factor": short, "long_factor": long[:5]})
    with pytest.raises(ConfigError, match=r"rope_scaling.short_factor must be a list of positive"):
        load(rope_scaling={"type": "longrope", "short_factor": [0] * 6, "long_factor": long})
    with pytest.raises(ConfigError, match=r"rope_scaling.short_factor.*is missing"):
        load(rope_scaling={"type": "longrope", "long_factor": long})


# --- GGUF -----------------------------------------------------------------------------------


def q4_k_m(name: str, shape: tuple[int, ...]) -> T:
    """llama.cpp's Q4_K_M choices for phi3: attn_qkv Q5_K, ffn_down Q6_K (in the layers
    use_more_bits picks; here layer 1), output Q6_K, the rest Q4_K."""
    if ".attn_qkv." in name:
        return T.Q5_K
    if name == "blk.1.ffn_down.weight" or name.startswith("output."):
        return T.Q6_K
    return T.Q4_K


@pytest.fixture(scope="module")
def phi3_gguf(gguf_file, tmp_path_factory):
    """qtype -> (GGUF file, the Hugging Face fixture it was written from)."""
    root = tmp_path_factory.mktemp("phi3-gguf")
    return gguf_files(
        root, lambda q: gguf_file.source(ARCH, T.Q4_K if q == "Q4_K_M" else T.F32), q4_k_m
    )


def test_gguf_config_equals_the_hf_one(phi3_gguf):
    path, source = phi3_gguf("F16")
    checked = read_gguf_model(path)
    assert {"rope_factors_long.weight", "blk.0.attn_qkv.weight"} <= set(checked.tensors)
    ours, hf = checked.config, load_model_config(source)
    assert ours.recipe.rotary_dim == hf.recipe.rotary_dim == 12
    assert ours.sliding_window is None and not ours.tie_word_embeddings
    for key in ("short_factor", "long_factor"):  # stored as F32
        assert ours.rope_scaling[key] == pytest.approx(hf.rope_scaling[key], rel=1e-6)
    assert ours.rope_scaling["attention_factor"] == pytest.approx(math.sqrt(2))
    torch.testing.assert_close(
        cos_sin_table(12, 80, ours.rope_theta, ours.rope_scaling),
        cos_sin_table(12, 80, hf.rope_theta, hf.rope_scaling),
    )


@pytest.mark.parametrize("kind", QTYPES)
def test_gguf_fp32_logits_match_transformers(kind, phi3_gguf, hf_gguf):
    """Dequantized (torch kernels) against transformers' GGUF loader on the same file, given
    the fixture's config.json (its GGUF mapping for phi3 reads no LongRoPE)."""
    path, source = phi3_gguf(kind)
    prompt = parity_prompt(40, seed=9)
    want = hf_logits_token_by_token(hf_gguf(path, source), prompt, ORIGINAL_LENGTH)
    got = prefill_logits(runner(path), prompt)
    assert_close_fp32(got, want)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K_M"])
def test_gguf_kept_quantized_close_to_transformers(kind, dtype, phi3_gguf, hf_gguf):
    """Linears kept in the file's blocks, the fused ones included (each rank's q, k, v and
    gate, up rows read as blocks), on the native int8 GEMM: test_gguf_quantized's bounds."""
    path, source = phi3_gguf(kind)
    run = runner(path, DTYPES[dtype], "native")
    layer = run.model.model.layers[1]
    qkv_types = {"Q8_0": ["Q8_0"], "Q4_K_M": ["Q5_K"]}[kind]
    assert [w.qtype for _, w in layer.self_attn.qkv_proj.quant] == qkv_types
    assert layer.mlp.gate_up_proj.quant is not None and layer.mlp.gate_up_proj.weight is None
    prompt = parity_prompt(40, seed=10)
    want = hf_logits_token_by_token(hf_gguf(path, source), prompt, ORIGINAL_LENGTH)
    assert_quantized_close(prefill_logits(run, prompt), want)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["F16", "Q4_K_M"])
def test_gguf_tp2_tokens_equal_tp1(kind, phi3_gguf):
    path, _ = phi3_gguf(kind)
    prompts = [parity_prompt(5, seed=11), parity_prompt(45, seed=12)]
    params = greedy(16)
    expected = [
        o.outputs[0].token_ids for o in LLM(path, dtype="float32").generate(prompts, params)
    ]
    with LLM(path, tp=2, bind="0|1", dtype="float32") as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
