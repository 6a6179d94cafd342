"""The fused decoder's decode path (one thread team for the layer stack, x quantized once per
input for quantized linears) against the per-op path: the same logits bit for bit for a
single decode, a batch of decodes and a decode beside a prefill chunk, on quantized GGUF and
packed bf16 linears and on quantized and packed bf16 expert (MoE) layers; a prefill larger
than a team step takes per-op regions and matches too."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_moe_gguf import write_moe_gguf

from cpud.model.load import load_model_config
from cpud.protocol.step import SeqWork, StepPlan
from cpud.ranks.fused_decoder import FusedDecoder
from cpud.ranks.model_runner import ModelRunner, RunnerConfig
from cpud.ranks.parallel import SingleRank

PROMPTS = [[(37 * i + 11 * s) % 400 + 3 for i in range(20 + 7 * s)] for s in range(3)]


def blocks(seq: int, tokens: int) -> list[int]:
    return list(range(8 * seq, 8 * seq + -(-tokens // 16)))


def steps() -> list[StepPlan]:
    """Prefill of three prompts (over the team's token count), one decode, a decode of all
    three, then a decode beside a 9-token chunk of the third prompt's continuation."""
    lens = [len(p) for p in PROMPTS]
    prefill = [SeqWork(s, p, 0, blocks(s, len(p) + 12), False) for s, p in enumerate(PROMPTS)]
    one = [SeqWork(0, [5], lens[0], blocks(0, lens[0] + 12), True)]
    three = [
        SeqWork(s, [6 + s], lens[s] + (s == 0), blocks(s, lens[s] + 12), True) for s in range(3)
    ]
    mixed = [
        SeqWork(0, [9], lens[0] + 2, blocks(0, lens[0] + 12), True),
        SeqWork(2, list(range(40, 49)), lens[2] + 1, blocks(2, lens[2] + 12), True),
    ]
    return [StepPlan(i, seqs) for i, seqs in enumerate((prefill, one, three, mixed))]


@pytest.mark.parametrize(
    ("qtype", "dtype"),
    [(T.Q8_0, torch.bfloat16), (T.Q4_K, torch.bfloat16), (T.Q4_1, torch.float32)],
    ids=["Q8_0-bf16", "Q4_K-bf16", "Q4_1-fp32"],
)
def test_team_decode_equals_the_per_op_path(qtype, dtype, gguf_file):
    assert_team_equals_per_op(gguf_file("qwen3", qtype), dtype)


@pytest.mark.parametrize("kv", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("threads", [1, 3, 5])
def test_team_on_more_threads_than_tokens_or_heads_equals_the_per_op_path(threads, kv, gguf_file):
    """With fewer tokens than threads the team splits the work between its linears by heads and
    by blocks of 32 columns (at 5 threads some threads get no KV head), and the threads take
    each other's linear tasks once their own are done; at one thread nothing is split. Each
    gives the per-op path's bits, on every KV cache format."""
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        assert_team_equals_per_op(gguf_file("qwen3", T.Q4_K), torch.bfloat16, kv)
    finally:
        torch.set_num_threads(old)


def long_steps() -> list[StepPlan]:
    """A 2100-token prompt, then decodes past it (each query split into three ranges of its
    keys, att_plan.h) beside a short sequence's, then four of its tokens in one step."""
    long = [(13 * i) % 397 + 3 for i in range(2100)]
    table = list(range(140))
    prefill = [SeqWork(0, long, 0, table, False), SeqWork(1, PROMPTS[1], 0, [140, 141], False)]
    decode = [
        SeqWork(0, [7], 2100, table, True),
        SeqWork(1, [8], len(PROMPTS[1]), [140, 141], True),
    ]
    verify = [SeqWork(0, [9, 10, 11, 12], None, [], True)]  # four queries at once, split too
    return [
        StepPlan(0, prefill),
        StepPlan(1, decode),
        StepPlan(2, [decode[0]]),
        StepPlan(3, verify),
    ]


@pytest.mark.parametrize("kv", ["auto", "int8"])
@pytest.mark.parametrize("threads", [1, 3])
def test_team_decode_over_split_contexts_equals_the_per_op_path(threads, kv, gguf_file):
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        assert_team_equals_per_op(gguf_file("qwen3", T.Q8_0), torch.bfloat16, kv, long_steps())
    finally:
        torch.set_num_threads(old)


def test_team_decode_on_packed_bf16_linears_equals_the_per_op_path(model_factory):
    assert_team_equals_per_op(model_factory("qwen3"), torch.bfloat16)


def test_team_runs_quantized_expert_layers_like_the_per_op_path(model_factory, tmp_path):
    path = tmp_path / "moe.gguf"
    write_moe_gguf(model_factory("qwen3_moe"), path, T.Q8_0, T.Q8_0, keep_values=False)
    assert_team_equals_per_op(path, torch.bfloat16)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_team_runs_packed_bf16_expert_layers_like_the_per_op_path(arch, model_factory):
    assert_team_equals_per_op(model_factory(arch), torch.bfloat16)


def assert_team_equals_per_op(
    path, dtype: torch.dtype, kv: str = "auto", plans: list[StepPlan] | None = None
) -> None:
    """The steps (steps() by default) on two runners, each with its own KV cache: one fused, one
    per op (so a KV row the team failed to write shows in the later steps' logits)."""
    config = RunnerConfig(
        path, dtype, 4096, 16, 144, kernels="native", kv_pretouch=False, kv_cache_dtype=kv
    )
    run = ModelRunner(config, load_model_config(path), SingleRank())
    per_op_run = ModelRunner(config, load_model_config(path), SingleRank())
    per_op_run.decoder = None
    assert isinstance(run.decoder, FusedDecoder)
    for plan in plans or steps():
        teams = run.decoder.team_steps
        fused, per_op = run.prompt_logits(plan), per_op_run.prompt_logits(plan)
        assert torch.isfinite(fused).all()
        assert torch.equal(fused, per_op), plan.step_id
        tokens = sum(len(seq.token_ids) for seq in plan.seqs)
        assert run.decoder.team_steps - teams == (tokens <= 32), plan.step_id
