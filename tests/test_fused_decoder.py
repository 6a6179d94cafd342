"""The fused decoder (one native call for the layer stack) against the per-op path it replaces:
the same logits bit for bit, for every Llama-family option, single rank and tp=2 over the
shared-memory group; bad plans and broken groups raise instead of crashing."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from cpud import LLM, native
from cpud.model.load import load_model_config
from cpud.protocol.step import SeqWork, StepPlan
from cpud.ranks.fused_decoder import FusedDecoder, unsupported_reason
from cpud.ranks.model_runner import ModelRunner, RunnerConfig
from cpud.ranks.stats import TimedGroup

pytestmark = pytest.mark.skipif(not native.available(), reason="native library not built")

PROMPT_A = [(37 * i + 11) % 500 + 3 for i in range(37)]
PROMPT_B = [(53 * i + 7) % 500 + 3 for i in range(21)]


def blocks_for(tokens: int, first: int, block_size: int = 16) -> list[int]:
    return list(range(first, first + -(-tokens // block_size)))


def both_paths(runner: ModelRunner, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(fused logits, per-op logits) of one plan; both write the same KV slots."""
    decoder = runner.decoder
    assert decoder is not None
    try:
        runner.decoder = None
        per_op = runner.prompt_logits(plan)
    finally:
        runner.decoder = decoder
    return runner.prompt_logits(plan), per_op


def prefill_then_mixed(runner: ModelRunner) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A two-sequence prefill, then a step where A decodes one token and B prefills a chunk
    on top of its cached prefix."""
    a_blocks = blocks_for(len(PROMPT_A) + 1, 0)
    b_blocks = blocks_for(len(PROMPT_B) + 9, 8)
    prefill = StepPlan(
        0,
        [
            SeqWork(0, PROMPT_A, 0, a_blocks, False),
            SeqWork(1, PROMPT_B[:12], 0, blocks_for(12, 8), False),
        ],
    )
    mixed = StepPlan(
        1,
        [
            SeqWork(0, [42], len(PROMPT_A), a_blocks, True),
            SeqWork(1, PROMPT_B[12:], 12, b_blocks[: len(blocks_for(len(PROMPT_B), 8))], True),
        ],
    )
    return [both_paths(runner, prefill), both_paths(runner, mixed)]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_fused_logits_equal_the_per_op_path(arch, model_factory):
    llm = LLM(model_factory(arch), dtype="bfloat16", kernels="native")
    runner = llm.engine.executor.runner
    assert isinstance(runner.decoder, FusedDecoder)
    for fused, per_op in prefill_then_mixed(runner):
        assert torch.isfinite(fused).all()
        assert torch.equal(fused, per_op)


def test_linear_time_and_bytes_are_counted(model_factory):
    """The decoder times its dense linears (the figure perf/bench_gguf_decode.py divides the
    weight bytes by): time grows with every step, the bytes are those of the packed weights."""
    llm = LLM(model_factory("qwen3"), dtype="bfloat16", kernels="native")
    runner = llm.engine.executor.runner
    decoder = runner.decoder
    packed = [
        lin.packed.data.nbytes
        for layer in decoder.table.layers
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ]
    assert decoder.linear_bytes == sum(packed) > 0
    before = decoder.linear_seconds
    prefill_then_mixed(runner)
    middle = decoder.linear_seconds
    runner.prompt_logits(StepPlan(2, [SeqWork(0, [7], len(PROMPT_A) + 1, blocks_for(48, 0), True)]))
    assert before < middle < decoder.linear_seconds


def test_o_bias_and_sliding_window_match(model_factory):
    """Options no fixture checkpoint has: a row-parallel o_proj bias (added after the
    all-reduce) and a sliding window shorter than the prompt."""
    llm = LLM(model_factory("llama"), dtype="bfloat16", kernels="native")
    runner = llm.engine.executor.runner
    gen = torch.Generator().manual_seed(0)
    for layer in runner.model.model.layers:
        attn = layer.self_attn
        bias = torch.randn(attn.o_proj.packed.n, generator=gen).to(torch.bfloat16)
        attn.o_proj.bias = nn.Parameter(bias, requires_grad=False)
        attn.attn.sliding_window = 5
    runner.decoder = FusedDecoder(runner.model, runner.ops, runner.group, runner.kv_caches)
    results = prefill_then_mixed(runner)
    for fused, per_op in results:
        assert torch.equal(fused, per_op)
    plain = LLM(model_factory("llama"), dtype="bfloat16", kernels="native")
    unbiased, _ = prefill_then_mixed(plain.engine.executor.runner)[0]
    assert not torch.equal(results[0][0], unbiased)  # the bias and window did change something


def test_greedy_generation_is_unchanged(model_factory):
    model_dir = model_factory("qwen3")
    prompts = [PROMPT_A, PROMPT_B, PROMPT_B[:5]]
    fused = LLM(model_dir, dtype="bfloat16", kernels="native")
    per_op = LLM(model_dir, dtype="bfloat16", kernels="native")
    per_op.engine.executor.runner.decoder = None
    params = None
    got = [o.outputs[0].token_ids for o in fused.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in per_op.generate(prompts, params)]
    assert got == want and all(got)


def test_plans_out_of_range_raise(model_factory):
    llm = LLM(
        model_factory("qwen3"),
        dtype="bfloat16",
        kernels="native",
        num_kv_blocks=8,
        max_model_len=128,
    )
    runner = llm.engine.executor.runner
    past_cache = StepPlan(0, [SeqWork(0, [5, 6, 7], 0, [8], False)])
    with pytest.raises(ValueError, match="out of range"):
        runner.prompt_logits(past_cache)
    past_positions = StepPlan(0, [SeqWork(0, [5], 10_000, [0] * 626, False)])
    with pytest.raises(ValueError, match="out of range"):
        runner.prompt_logits(past_positions)
    ok = StepPlan(0, [SeqWork(0, PROMPT_B, 0, [0, 1], False)])
    assert torch.isfinite(runner.prompt_logits(ok)).all()  # the runner is still usable


def test_unsupported_setups_run_op_by_op(model_factory):
    torch_ops = LLM(model_factory("qwen3"), dtype="bfloat16", kernels="torch")
    runner = torch_ops.engine.executor.runner
    assert runner.decoder is None
    assert "not native" in unsupported_reason(runner.model, runner.ops, runner.group)
    fp32 = LLM(model_factory("qwen3"), dtype="float32", kernels="native").engine.executor.runner
    assert fp32.decoder is None
    assert "not packed" in unsupported_reason(fp32.model, fp32.ops, fp32.group)
    opt = LLM(model_factory("opt"), dtype="bfloat16", kernels="native").engine.executor.runner
    assert opt.decoder is None
    assert "not a recipe decoder" in unsupported_reason(opt.model, opt.ops, opt.group)

    class OtherGroup:
        rank, size = 0, 2

    bf16 = LLM(model_factory("qwen3"), dtype="bfloat16", kernels="native").engine.executor.runner
    reason = unsupported_reason(bf16.model, bf16.ops, OtherGroup())
    assert "not the shared-memory group" in reason
    with pytest.raises(ValueError, match="fused decoder"):
        FusedDecoder(fp32.model, fp32.ops, fp32.group, fp32.kv_caches)


def tp2_runners(model_dir, path: str) -> tuple[list[ModelRunner], list[TimedGroup], object]:
    from cpud.native import ShmGroup

    owner = ShmGroup.create(path, 2)
    groups = [TimedGroup(ShmGroup.attach(path, rank, 2, timeout=20.0)) for rank in range(2)]
    cfg = load_model_config(model_dir)
    config = RunnerConfig(model_dir, torch.bfloat16, 256, 16, 32, kernels="native")
    return [ModelRunner(config, cfg, g) for g in groups], groups, owner


def run_ranks(runners: list[ModelRunner], plan: StepPlan) -> list[torch.Tensor | BaseException]:
    results: list = [None, None]

    def run(rank: int) -> None:
        try:
            results[rank] = runners[rank].prompt_logits(plan)
        except BaseException as exc:  # handed to the test
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_tp2_over_shared_memory_matches_and_counts_all_reduces(model_factory, tmp_path):
    model_dir = model_factory("qwen3")
    runners, groups, owner = tp2_runners(model_dir, str(tmp_path / "ar.shm"))
    assert all(isinstance(r.decoder, FusedDecoder) for r in runners)
    plan = StepPlan(0, [SeqWork(0, PROMPT_A, 0, blocks_for(len(PROMPT_A), 0), False)])
    fused = run_ranks(runners, plan)
    layers = len(runners[0].model.model.layers)
    # embedding (per-op, Python) + two per layer inside the native call
    assert [g.calls for g in groups] == [1 + 2 * layers] * 2
    assert all(g.seconds > 0 for g in groups)
    decoders = [r.decoder for r in runners]
    for r in runners:
        r.decoder = None
    per_op = run_ranks(runners, plan)
    assert isinstance(fused[0], torch.Tensor) and torch.equal(fused[0], per_op[0])
    for r, d in zip(runners, decoders):
        r.decoder = d
    owner.abort(1)  # e.g. the supervisor saw rank 1 die
    failed = run_ranks(runners, plan)
    assert all(isinstance(e, native.GroupAborted) for e in failed), failed
    assert "rank 1" in str(failed[0])
