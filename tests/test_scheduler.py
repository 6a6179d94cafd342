"""Scheduling: token budget, sequence limit, preemption by recompute, aborts."""

from __future__ import annotations

import random

import pytest

from cpud import LLM, SamplingParams
from cpud.engine.block_manager import BlockManager
from cpud.engine.detokenizer import IncrementalDetokenizer
from cpud.engine.scheduler import Scheduler
from cpud.engine.sequence import SeqStatus, Sequence
from hf_reference import hf_greedy


class NullDecoder:
    def decode(self, token_ids, skip_special_tokens=True):
        return ""


def make_seq(seq_id: int, length: int) -> Sequence:
    return Sequence(
        seq_id,
        str(seq_id),
        0,
        list(range(10, 10 + length)),
        SamplingParams(),
        IncrementalDetokenizer(NullDecoder()),
        None,
    )


def run_step(scheduler: Scheduler) -> list[tuple[int, int]]:
    out = scheduler.schedule()
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_tokens
        if item.seq.num_uncomputed == 0:
            item.seq.token_ids.append(1)
    return [(item.seq.seq_id, item.num_tokens) for item in out.scheduled]


def test_budget_chunks_prefill_and_decodes_go_first():
    scheduler = Scheduler(BlockManager(100, 16, False), max_num_seqs=8, max_batched_tokens=32)
    scheduler.add(make_seq(0, 50))
    scheduler.add(make_seq(1, 20))
    assert run_step(scheduler) == [(0, 32)]
    assert run_step(scheduler) == [(0, 18), (1, 14)]
    assert run_step(scheduler) == [(0, 1), (1, 6)]  # seq 0 decodes, seq 1 finishes prefill
    assert run_step(scheduler) == [(0, 1), (1, 1)]


def test_max_num_seqs_limits_running():
    scheduler = Scheduler(BlockManager(100, 16, False), max_num_seqs=2, max_batched_tokens=512)
    for i in range(4):
        scheduler.add(make_seq(i, 5))
    assert [sid for sid, _ in run_step(scheduler)] == [0, 1]
    assert len(scheduler.running) == 2 and len(scheduler.waiting) == 2


def test_preemption_frees_newest_and_requeues_it_first():
    bm = BlockManager(4, 16, False)
    scheduler = Scheduler(bm, max_num_seqs=8, max_batched_tokens=512)
    a, b = make_seq(0, 31), make_seq(1, 31)
    scheduler.add(a)
    scheduler.add(b)
    assert run_step(scheduler) == [(0, 31), (1, 31)]  # 2 blocks each, all 4 used
    assert run_step(scheduler) == [(0, 1), (1, 1)]  # both fill their second block
    out = scheduler.schedule()  # a needs a third block: b is preempted
    assert out.preempted == [b]
    assert [item.seq for item in out.scheduled] == [a]
    assert b.status is SeqStatus.WAITING and b.num_computed_tokens == 0
    assert scheduler.waiting[0] is b and b.blocks.block_ids == []
    assert bm.num_free == 1


def test_finish_releases_blocks_from_any_queue():
    bm = BlockManager(10, 16, False)
    scheduler = Scheduler(bm, max_num_seqs=1, max_batched_tokens=512)
    running, waiting = make_seq(0, 20), make_seq(1, 20)
    scheduler.add(running)
    scheduler.add(waiting)
    run_step(scheduler)
    scheduler.finish(waiting)
    scheduler.finish(running)
    assert bm.num_free == 10 and not scheduler.has_work()


GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("arch", ["qwen3", "opt"])
def test_preemption_under_tiny_kv_cache_gives_same_tokens(arch, model_factory, hf_models):
    model_dir = model_factory(arch)
    rng = random.Random(7)
    prompts = [[rng.randrange(4, 400) for _ in range(n)] for n in (40, 35, 44, 38)]
    # Each request needs 5 blocks of 16 at its end; 4 run at once would need 20.
    llm = LLM(
        model_dir, dtype="float32", num_kv_blocks=12, max_model_len=192, enable_prefix_caching=False
    )
    outputs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    model = hf_models(model_dir)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(model, prompt, 40)
    assert llm.engine.blocks.num_free == 12
    assert not llm.engine.scheduler.has_work()


def test_free_blocks_restored_after_every_request_and_abort(model_factory):
    llm = LLM(model_factory("llama"), dtype="float32", num_kv_blocks=40, max_model_len=640)
    engine = llm.engine
    for n in (1, 17, 64):
        llm.generate([list(range(5, 5 + n))], SamplingParams(max_tokens=5, temperature=0))
        assert engine.blocks.num_free == 40 and engine.requests == {}
    engine.add_request("x", list(range(5, 60)), SamplingParams(max_tokens=50))
    engine.step()
    assert engine.blocks.num_free < 40
    engine.abort("x")
    assert engine.blocks.num_free == 40 and not engine.has_unfinished()
    assert not engine.scheduler.has_work()


def test_running_prefill_leaves_room_for_waiting_requests():
    scheduler = Scheduler(BlockManager(100, 16, False), max_num_seqs=8, max_batched_tokens=64)
    scheduler.add(make_seq(0, 600))
    assert run_step(scheduler) == [(0, 64)]  # alone: the whole budget
    scheduler.add(make_seq(1, 10))
    assert run_step(scheduler) == [(0, 48), (1, 10)]  # a quarter left to admit seq 1
    # seq 1 decodes first; nothing waits, so seq 0 takes the rest of the budget again
    assert run_step(scheduler) == [(1, 1), (0, 63)]


def test_prefix_lookup_counts_once_per_admission_not_per_waiting_step():
    bm = BlockManager(4, 16, True)
    scheduler = Scheduler(bm, max_num_seqs=8, max_batched_tokens=512)
    scheduler.add(make_seq(0, 48))  # 3 blocks: only one is left free
    run_step(scheduler)
    waiting = make_seq(1, 40)  # it needs 3 blocks
    scheduler.add(waiting)
    for _ in range(3):
        run_step(scheduler)
    assert waiting.status is SeqStatus.WAITING
    assert (bm.prefix_queries, bm.prefix_hits) == (2, 0)  # seq 0's own lookup only
    scheduler.finish(scheduler.running[0])
    run_step(scheduler)
    assert waiting.status is SeqStatus.RUNNING
    assert bm.prefix_queries == 4  # its two full blocks, looked up once at admission
