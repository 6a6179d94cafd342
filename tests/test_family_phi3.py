"""Phi-3 / Phi-4-mini (ranks/models/families/phi3.py) against transformers: fused qkv_proj and
gate_up_proj split per rank, partial rotary, LongRoPE across the original length (32 of 1024
positions in the fixture), from the HF directory and from GGUF files (F16, Q8_0, Q4_K_M)."""

from __future__ import annotations

import json
import math
import random
import shutil

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf_writer import write_gguf
from safetensors import safe_open
from test_tp_sharding import ThreadGroupHub, ThreadRank, logits_with

from cpud import LLM, SamplingParams, native
from cpud.fixtures.archs.phi3 import ORIGINAL_LENGTH, TINY, factors
from cpud.model.gguf_model import read_gguf_model
from cpud.model.load import load_model_config
from cpud.protocol.step import SeqWork, StepPlan
from cpud.ranks.layers.rotary import cos_sin_table
from cpud.ranks.loader import load_weights
from cpud.ranks.model_runner import ModelRunner, RunnerConfig
from cpud.ranks.models.build import build_model
from cpud.ranks.parallel import SingleRank
from cpud.settings.errors import ConfigError
from hf_reference import hf_greedy, hf_logits

NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
needs_native = pytest.mark.skipif(not native.available(), reason="native library not built")


def prompt_of(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 500) for _ in range(length)]


def runner(path, dtype: torch.dtype = torch.float32, kernels: str = "torch") -> ModelRunner:
    config = RunnerConfig(path, dtype, 512, 16, 32, kernels=kernels, kv_pretouch=False)
    return ModelRunner(config, load_model_config(path), SingleRank())


def prefill_logits(run: ModelRunner, prompt: list[int], chunk: int = 0) -> torch.Tensor:
    """Logits of every prompt token: one step, or chunks of `chunk` tokens."""
    chunk = chunk or len(prompt)
    out = []
    for step, start in enumerate(range(0, len(prompt), chunk)):
        part = prompt[start : start + chunk]
        blocks = list(range(-(-(start + len(part)) // 16)))
        out.append(run.prompt_logits(StepPlan(step, [SeqWork(0, part, start, blocks, False)])))
    return torch.cat(out).float()


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


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.std()))


@pytest.fixture(scope="module")
def phi3(model_factory):
    return model_factory("phi3")


def test_config_and_recipe(phi3):
    cfg = load_model_config(phi3)
    assert (cfg.family, cfg.architecture) == ("phi3", "Phi3ForCausalLM")
    assert cfg.recipe.rotary_dim == 12 and cfg.head_dim == 16  # 0.75 of each head rotates
    scaling = cfg.rope_scaling
    assert scaling["rope_type"] == "longrope" and scaling["factor"] == 1024 / 32
    assert scaling["original_max_position_embeddings"] == ORIGINAL_LENGTH
    assert cfg.sliding_window is None and not cfg.qkv_bias and not cfg.tie_word_embeddings
    assert "longrope scaling" in cfg.recipe.describe()


def test_cos_sin_table_switches_to_long_factors_at_the_original_length(phi3):
    """Positions below original_max_position_embeddings turn by the short factors, the rest by
    the long ones; both scaled by sqrt(1 + ln(1024 / 32) / ln 32) = sqrt(2)."""
    scaling = load_model_config(phi3).rope_scaling
    table = cos_sin_table(12, 100, 10000.0, scaling)
    positions = torch.arange(100, dtype=torch.float32)[:, None]
    base = 10000.0 ** (torch.arange(0, 12, 2).float() / 12)
    short, long = (torch.tensor(scaling[k]) for k in ("short_factor", "long_factor"))
    assert not torch.equal(short, long)
    for rows, chosen in ((slice(0, 32), short), (slice(32, 100), long)):
        angles = positions[rows] / (chosen * base)
        want = torch.cat((angles.cos(), angles.sin()), -1) * math.sqrt(2)
        torch.testing.assert_close(table[rows], want)


@pytest.mark.parametrize("kernels", ["torch", pytest.param("native", marks=needs_native)])
def test_fp32_logits_match_transformers(phi3, hf_models, kernels):
    prompt = prompt_of(ORIGINAL_LENGTH - 2, seed=1)  # all short factors: one HF forward agrees
    want = hf_logits(hf_models(phi3), prompt)
    close(prefill_logits(runner(phi3, kernels=kernels), prompt), want)


def test_a_prompt_past_the_original_length(phi3, hf_models):
    """cpud's logits over a 70-token prompt equal transformers run token by token with its
    cache past the original length (each position keeps its own factors). One transformers
    forward over the whole prompt rotates every position by the long factors (its longrope
    picks one set per call, by the largest position): the positions below 32 then differ from
    cpud's, which equal transformers' forward over those 32 tokens alone."""
    model = hf_models(phi3)
    prompt = prompt_of(70, seed=2)
    got = prefill_logits(runner(phi3), prompt)
    close(got, hf_logits_token_by_token(model, prompt, ORIGINAL_LENGTH))
    close(got[:ORIGINAL_LENGTH], hf_logits(model, prompt[:ORIGINAL_LENGTH]))
    whole = hf_logits(model, prompt)
    assert float((got[:ORIGINAL_LENGTH] - whole[:ORIGINAL_LENGTH]).abs().max()) > whole.std()


# test_parity's bf16 bounds, in units of the fp32 reference logits' standard deviation
BF16_MAX_ERROR, BF16_MEAN_ERROR = 0.5, 0.05


@pytest.mark.parametrize("kernels", ["torch", pytest.param("native", marks=needs_native)])
def test_bf16_logits_close_to_transformers(phi3, hf_models, kernels):
    prompt = prompt_of(30, seed=3)
    reference = hf_logits(hf_models(phi3, torch.float32), prompt)
    hf_bf16 = hf_logits(hf_models(phi3, torch.bfloat16), prompt)
    ours = prefill_logits(runner(phi3, torch.bfloat16, kernels), prompt)
    sigma = reference.std()
    ours_err, hf_err = (ours - reference).abs() / sigma, (hf_bf16 - reference).abs() / sigma
    assert float(ours_err.max()) < BF16_MAX_ERROR and float(ours_err.mean()) < BF16_MEAN_ERROR
    assert float(ours_err.max()) <= 1.25 * float(hf_err.max()) + 0.02
    assert float(ours_err.mean()) <= 1.25 * float(hf_err.mean()) + 0.005
    assert float((ours.argmax(-1) == reference.argmax(-1)).float().mean()) >= 0.85


ENGINE_SETTINGS = {
    "default": {},
    "torch-kernels": {"kernels": "torch"},
    "chunked": {"max_num_batched_tokens": 24},  # the 45-token prompt in 2 chunks across 32
}


@pytest.fixture(scope="module")
def greedy_reference(phi3, hf_models):
    """Prompts below and across the original length (generation crossing it) and
    transformers' tokens for them."""
    model = hf_models(phi3)
    prompts = [prompt_of(n, seed=n) for n in (5, 24, 45)]
    expected = [hf_greedy_by_position(model, p, NEW_TOKENS) for p in prompts]
    assert expected[:2] == [hf_greedy(model, p, NEW_TOKENS) for p in prompts[:2]]
    return prompts, expected


@pytest.mark.parametrize("settings", list(ENGINE_SETTINGS))
def test_greedy_tokens_match_transformers(phi3, greedy_reference, settings):
    prompts, expected = greedy_reference
    llm = LLM(phi3, dtype="float32", **ENGINE_SETTINGS[settings])
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected


def test_chunked_prefill_equals_one_step(phi3):
    prompt = prompt_of(70, seed=4)
    run = runner(phi3)
    whole = prefill_logits(run, prompt)
    for chunk in (16, 23):
        close(prefill_logits(run, prompt, chunk), whole)


def test_prefix_cache_hits_keep_tokens_identical(phi3, hf_models):
    model = hf_models(phi3)
    shared = prompt_of(50, seed=5)  # 3 cached blocks, across the original length
    prompts = [shared + prompt_of(n, seed=6 + n) for n in (3, 20)]
    llm = LLM(phi3, dtype="float32", max_num_batched_tokens=40)
    first = llm.generate(prompts[:1], GREEDY)
    hits = llm.engine.blocks.prefix_hits
    second = llm.generate(prompts, GREEDY)
    assert llm.engine.blocks.prefix_hits - hits >= 2 * (50 // 16)
    assert second[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    for prompt, output in zip(prompts, second):
        assert output.outputs[0].token_ids == hf_greedy_by_position(model, prompt, NEW_TOKENS)


def test_each_rank_reads_its_rows_of_the_fused_tensors(phi3):
    """At TP=2 rank r holds q rows r*32.., k and v rows r*16.. of qkv_proj (q 64, k 32, v 32
    rows in the checkpoint) and gate, up rows r*64.. of gate_up_proj (gate 128, up 128)."""
    cfg = load_model_config(phi3)
    with safe_open(phi3 / "model.safetensors", "pt") as f:
        qkv = f.get_tensor("model.layers.1.self_attn.qkv_proj.weight")
        gate_up = f.get_tensor("model.layers.1.mlp.gate_up_proj.weight")
    q, k, v = qkv.split([64, 32, 32])
    gate, up = gate_up.split([128, 128])
    hub = ThreadGroupHub(2)
    for rank in range(2):
        model = build_model(cfg, 64, torch.float32, ThreadRank(hub, rank))
        load_weights(model, phi3)
        layer = model.model.layers[1]
        want_qkv = torch.cat([q.chunk(2)[rank], k.chunk(2)[rank], v.chunk(2)[rank]])
        assert torch.equal(layer.self_attn.qkv_proj.weight, want_qkv)
        want_gate_up = torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]])
        assert torch.equal(layer.mlp.gate_up_proj.weight, want_gate_up)


def test_tp2_logits_equal_tp1(phi3):
    prompt = prompt_of(45, seed=7)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        full, sharded = logits_with(phi3, prompt, 1), logits_with(phi3, prompt, 2)
    finally:
        torch.set_num_threads(threads)
    close(sharded, full)


def test_sliding_window_as_transformers(phi3, hf_models, tmp_path):
    """sliding_window (Phi-3-mini: 2047) limits attention to that many tokens, self included,
    as transformers' Phi3 masks it."""
    windowed = tmp_path / "phi3-window"
    shutil.copytree(phi3, windowed)
    config = json.loads((windowed / "config.json").read_text())
    (windowed / "config.json").write_text(json.dumps(config | {"sliding_window": 20}))
    assert load_model_config(windowed).recipe.windows == (20, 20)
    prompt = prompt_of(28, seed=8)
    want = hf_logits(hf_models(windowed), prompt)
    close(prefill_logits(runner(windowed), prompt), want)
    assert float((want - hf_logits(hf_models(phi3), prompt)).abs().max()) > want.std()


def test_su_is_longrope_and_bad_factors_are_refused(phi3, tmp_path):
    config = json.loads((phi3 / "config.json").read_text())
    short, long = factors(TINY)

    def load(**changes) -> object:
        folder = tmp_path / f"c{len(list(tmp_path.iterdir()))}"
        shutil.copytree(phi3, folder)
        (folder / "config.json").write_text(json.dumps(config | changes))
        return load_model_config(folder)

    old = load(rope_scaling={"type": "su", "short_factor": short, "long_factor": long})
    assert old.rope_scaling == load_model_config(phi3).rope_scaling | {"type": "su"}
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
    """qtype name -> (GGUF file, the HF fixture it was written from)."""
    made = {}

    def get(kind: str):
        if kind not in made:
            if kind == "Q4_K_M":
                source = gguf_file.source("phi3", T.Q4_K)
                path = write_gguf(source, tmp_path_factory.mktemp("q4km") / "m.gguf", q4_k_m)
            else:
                qtype = T[kind]
                source, path = gguf_file.source("phi3", qtype), gguf_file("phi3", qtype)
            made[kind] = (path, source)
        return made[kind]

    return get


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


@pytest.mark.parametrize("kind", ["F16", "Q8_0", "Q4_K_M"])
def test_gguf_fp32_logits_match_transformers(kind, phi3_gguf, hf_gguf):
    """Dequantized (torch kernels) against transformers' GGUF loader on the same file, given
    the fixture's config.json (its GGUF mapping for phi3 reads no LongRoPE)."""
    path, source = phi3_gguf(kind)
    prompt = prompt_of(40, seed=9)
    want = hf_logits_token_by_token(hf_gguf(path, source), prompt, ORIGINAL_LENGTH)
    got = prefill_logits(runner(path), prompt)
    close(got, want)
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
    prompt = prompt_of(40, seed=10)
    want = hf_logits_token_by_token(hf_gguf(path, source), prompt, ORIGINAL_LENGTH)
    got = prefill_logits(run, prompt)
    error = (got - want).abs() / want.std()
    assert float(error.max()) < 0.6 and float(error.mean()) < 0.05, (error.max(), error.mean())
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.8


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["F16", "Q4_K_M"])
def test_gguf_tp2_tokens_equal_tp1(kind, phi3_gguf):
    path, _ = phi3_gguf(kind)
    prompts = [prompt_of(5, seed=11), prompt_of(45, seed=12)]
    expected = [
        o.outputs[0].token_ids for o in LLM(path, dtype="float32").generate(prompts, GREEDY)
    ]
    with LLM(path, tp=2, bind="0|1", dtype="float32") as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
