"""Quantized mixture-of-experts GGUF files: the expert stacks stay in their blocks (one packed
stack per projection and layer) and run on the int8 kernels inside the native expert kernel.
Against transformers on the file's weights dequantized (the activations' int8 rounding is what
differs, as for dense quantized linears: family_checks.assert_quantized_close), greedy tokens,
TP=2 against TP=1, the weight cache, and the experts' resident bytes against the file's."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator

import pytest
import torch
from family_checks import assert_quantized_close, common_prefixes, prompt_of, sigma_error
from gguf import GGMLQuantizationType as T
from safetensors.numpy import load_file, save_file
from test_gguf_quantized import DTYPES, prefill_logits, runner
from test_moe_gguf import write_moe_gguf
from test_tp_sharding import ThreadGroupHub, ThreadRank, run_ranks

from cpud import LLM, SamplingParams
from cpud.model.load import load_model_config
from cpud.protocol.step import SeqWork, StepPlan
from cpud.ranks.gguf_experts import expert_bytes, expert_layers
from cpud.ranks.model_runner import ModelRunner, RunnerConfig
from cpud.ranks.parallel import SingleRank
from cpud.settings.errors import ConfigError
from hf_reference import hf_greedy, hf_logits

MIXES = {
    "Q8_0": dict.fromkeys(("gate", "up", "down"), T.Q8_0),
    "Q4_0": dict.fromkeys(("gate", "up", "down"), T.Q4_0),
    "Q4_K_M": {"gate": T.Q4_K, "up": T.Q4_K, "down": T.Q6_K},  # llama.cpp's Q4_K_M experts
    "Q4_K+Q8_0": {"gate": T.Q4_K, "up": T.Q4_K, "down": T.Q8_0},
}
# (arch, fixture preset, mix): the tiny fixtures' widths (64, 32) hold blocks of 32 only
CASES = [
    ("qwen3_moe", "tiny", "Q8_0"),
    ("mixtral", "tiny", "Q4_0"),
    ("qwen3_moe", "qwen3-moe-256", "Q4_K_M"),
]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [prompt_of(n, seed=n) for n in (1, 9, 40)]


@pytest.fixture(scope="module")
def quant_moe(model_factory, tmp_path_factory):
    """(arch, preset, mix) -> (GGUF path, an HF directory holding the file's weights)."""
    made = {}

    def make(arch: str, preset: str, mix: str):
        key = (arch, preset, mix)
        if key not in made:
            source = model_factory(arch, preset)
            root = tmp_path_factory.mktemp(f"{arch}-{mix}")
            path = root / "model.gguf"
            values = write_moe_gguf(source, path, MIXES[mix])
            reference = root / "hf"
            shutil.copytree(source, reference)
            tensors = load_file(str(source / "model.safetensors"))
            tensors.update((name, v.astype(tensors[name].dtype)) for name, v in values.items())
            save_file(tensors, str(reference / "model.safetensors"), metadata={"format": "pt"})
            made[key] = (path, reference)
        return made[key]

    return make


def assert_moe_quantized_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """assert_quantized_close's dense bounds outside the positions where a router near tie,
    tipped by the int8 rounding, picks another expert and that position's logits jump (about
    1σ, as bf16 rounding does in tests/test_moe.py): at most 2 of them, mean error over all
    positions still within the dense bound."""
    worst = sigma_error(got, want).max(-1).values
    kept = worst < 0.6
    assert int((~kept).sum()) <= 2, worst
    assert float(sigma_error(got, want).mean()) < 0.05
    assert_quantized_close(got[kept], want[kept])


def stack_types(model) -> set[tuple[str, str]]:
    return {(m.quant[0].qtype, m.quant[1].qtype) for m in expert_layers(model).values()}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch, preset, mix", CASES)
def test_quantized_experts_logits_close_to_transformers(
    arch, preset, mix, dtype, quant_moe, hf_models
):
    path, reference = quant_moe(arch, preset, mix)
    run = runner(path, DTYPES[dtype])
    types = MIXES[mix]
    assert stack_types(run.model) == {(types["gate"].name, types["down"].name)}
    for layer in expert_layers(run.model).values():
        assert layer.gate_up_proj is None and layer.down_proj is None  # no dense copy
    prompt = prompt_of(60, seed=4)
    want = hf_logits(hf_models(reference), prompt)
    assert_moe_quantized_close(prefill_logits(run, prompt), want)
    assert_moe_quantized_close(prefill_logits(run, prompt, chunk=16), want)


@pytest.mark.slow
@pytest.mark.parametrize("arch, preset, mix", CASES)
def test_quantized_experts_greedy_tokens(arch, preset, mix, quant_moe, hf_models):
    """int8 activations may flip a near tie, after which continuations part: the first
    tokens agree."""
    path, reference = quant_moe(arch, preset, mix)
    hf = hf_models(reference)
    llm = LLM(path, dtype="bfloat16", weight_cache="off")
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    prefixes = common_prefixes(got, [hf_greedy(hf, p, 8) for p in PROMPTS])
    assert sum(p > 0 for p in prefixes) >= 2 and sum(prefixes) >= 12, prefixes


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch on one thread inside: the ranks of tp_logits run as threads of this process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def tp_logits(path, prompt: list[int], tp: int) -> torch.Tensor:
    cfg = load_model_config(path)
    plan = StepPlan(0, [SeqWork(0, prompt, 0, list(range(-(-len(prompt) // 16))), False)])
    config = RunnerConfig(path, torch.float32, 256, 16, 16, kernels="native", weight_cache=None)
    hub = ThreadGroupHub(tp)
    runners = [ModelRunner(config, cfg, ThreadRank(hub, r)) for r in range(tp)]
    assert all(stack_types(r.model) for r in runners)
    return run_ranks(hub, [r.prompt_logits for r in runners], plan)[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch, preset, mix",
    [("qwen3_moe", "qwen3-moe-256", "Q4_K+Q8_0"), ("mixtral", "tiny", "Q8_0")],
)
def test_tp2_equals_tp1(arch, preset, mix, quant_moe):
    """Each rank packs its gate/up rows and its whole-block range of down's columns; the
    ranks' partial sums add up to the single rank's logits (fp32: up to summation order)."""
    path, _ = quant_moe(arch, preset, mix)
    prompt = prompt_of(20, seed=2)
    with one_torch_thread():
        full, sharded = tp_logits(path, prompt, 1), tp_logits(path, prompt, 2)
    torch.testing.assert_close(sharded, full, rtol=1e-3, atol=1e-3 * float(full.std()))


def test_tp_split_inside_a_block_is_refused(quant_moe):
    """Q6_K down stacks hold 256 columns a block: --tp 2 would cut the 256 in halves."""
    path, _ = quant_moe("qwen3_moe", "qwen3-moe-256", "Q4_K_M")
    with pytest.raises(ConfigError, match="--tp"):
        tp_logits(path, [5, 6, 7], 2)


@pytest.mark.parametrize("mix", ["Q8_0", "Q4_K_M"])
def test_resident_expert_bytes_near_file_size(mix, quant_moe, tmp_path, monkeypatch):
    """The packed stacks are the file's expert bytes plus at most Q4_K's 2.8 % of scales; a
    second load maps them from the weight cache and gives the same logits."""
    import gguf

    preset = "tiny" if mix == "Q8_0" else "qwen3-moe-256"
    path, _ = quant_moe("qwen3_moe", preset, mix)
    reader = gguf.GGUFReader(str(path))
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors if "_exps." in t.name)
    first = runner(path, torch.bfloat16, weight_cache=tmp_path)
    packed = expert_bytes(first.model)
    assert file_bytes <= packed <= 1.03 * file_bytes
    prompt = prompt_of(12, seed=1)
    want = prefill_logits(first, prompt)
    import cpud.native.moe_kernels as moe_kernels

    def unexpected(*args):
        raise AssertionError("experts repacked although the weight cache has them")

    monkeypatch.setattr(moe_kernels, "quant_stack", unexpected)
    again = runner(path, torch.bfloat16, weight_cache=tmp_path)
    assert expert_bytes(again.model) == packed
    torch.testing.assert_close(prefill_logits(again, prompt), want, rtol=0, atol=0)


def test_memory_plan_and_doctor_count_expert_blocks(quant_moe):
    """The memory plan sizes a GGUF file's expert stacks at their bytes in the file (dense,
    Q4_K experts would count 3.6 times that), and the doctor's weight table lists them with
    the int8 kernel that runs them."""
    import math

    from cpud.model.gguf_model import read_gguf_model
    from cpud.placement.memory_plan import quantized_weight_bytes, weight_bytes
    from cpud.ranks.quant_plan import weight_formats

    path, _ = quant_moe("qwen3_moe", "qwen3-moe-256", "Q4_K_M")
    cfg = load_model_config(path)
    checked = read_gguf_model(path)
    stacks = [i for i in checked.tensors.values() if len(i.shape) == 3]
    file_bytes = sum(i.n_bytes for i in stacks)
    dense_bytes = sum(math.prod(i.shape) * 2 for i in stacks)
    estimate = quantized_weight_bytes(cfg, "bfloat16", 1, path, "auto")
    assert estimate == weight_bytes(cfg, "bfloat16", 1) - dense_bytes + file_bytes
    rows = {fmt: (count, kernel) for fmt, count, kernel in weight_formats(path)}
    assert rows["Q4_K expert stacks"][0] == 2 * cfg.num_layers
    assert rows["Q6_K expert stacks"][0] == cfg.num_layers
    assert "int8 dot" in rows["Q4_K expert stacks"][1]


@pytest.mark.parametrize("arch, preset, mix", CASES)
def test_fused_decoder_runs_quantized_experts_like_the_per_op_path(arch, preset, mix, quant_moe):
    """The one-call decoder runs the quantized expert layers through their cpud_moe (the same
    native kernel the per-op path calls): the same logits bit for bit over a prefill and a
    mixed decode/prefill step."""
    from test_fused_decoder import prefill_then_mixed

    from cpud.ranks.fused_decoder import FusedDecoder

    path, _ = quant_moe(arch, preset, mix)
    run = LLM(path, dtype="bfloat16", weight_cache="off").engine.executor.runner
    assert isinstance(run.decoder, FusedDecoder) and stack_types(run.model)
    for fused, per_op in prefill_then_mixed(run):
        assert torch.isfinite(fused).all()
        assert torch.equal(fused, per_op)


def test_memory_plan_keeps_experts_dense_under_quantization(model_factory):
    """--quantization q8_0 quantizes a checkpoint's linears at load, not its experts: the plan
    counts the experts' bf16 stacks, so it bounds what the loaded model holds from above
    (counted as if in Q8_0 they would not be) and stays close to it."""
    from cpud.placement.memory_plan import quantized_weight_bytes
    from cpud.ranks.quant_linear import quant_bytes

    model_dir = model_factory("qwen3_moe")
    cfg = load_model_config(model_dir)
    config = RunnerConfig(
        model_dir, torch.bfloat16, 256, 16, 16, kernels="native", quantization="q8_0"
    )
    run = ModelRunner(config, cfg, SingleRank())
    experts = expert_layers(run.model).values()
    assert all(m.packed is not None for m in experts)
    held = sum(s.weight_bytes for m in experts for s in m.stacks())
    held += quant_bytes(run.model)
    held += sum(p.numel() * p.element_size() for p in run.model.parameters())
    estimate = quantized_weight_bytes(cfg, "bfloat16", 1, model_dir, "q8_0")
    assert held <= estimate <= 1.2 * held, (held, estimate)


@pytest.mark.slow
def test_prefix_cache_and_preemption_keep_tokens(quant_moe):
    """Quantized experts under prefix-cache hits and preemption give the tokens of a run with
    neither (the int8 rounding is per row, so a row's result does not depend on its step)."""
    path, _ = quant_moe("qwen3_moe", "qwen3-moe-256", "Q4_K_M")
    shared = prompt_of(70, seed=9)
    prompts = [shared + prompt_of(n, seed=n) for n in (3, 20)] + [prompt_of(50, seed=5)]
    long = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    plain = LLM(path, dtype="float32", weight_cache="off")
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, long)]
    small = LLM(
        path,
        dtype="float32",
        weight_cache="off",
        num_kv_blocks=14,
        max_num_batched_tokens=32,
        max_model_len=128,
    )
    small.generate(prompts[:1], long)
    hits = small.engine.blocks.prefix_hits
    got = [o.outputs[0].token_ids for o in small.generate(prompts, long)]
    assert small.engine.blocks.prefix_hits - hits >= 70 // 16
    assert small.engine.scheduler.num_preemptions > 0, "the test needs a preemption"
    assert got == want
