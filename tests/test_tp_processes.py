"""TP=2 with real rank processes on this 2-core machine (--bind "0|1"): same tokens as TP=1,
threads pinned to their cores and busy, and clean failure when a rank dies or hangs."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from cpud import LLM, SamplingParams
from cpud.engine.multiproc import RankDiedError
from cpud.settings.errors import ConfigError
from cpud_server_helpers import rank_pids

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 90)), [300, 12, 44]]
COLLECTIVES = ["gloo"]
try:
    from cpud.native import shm_allreduce  # noqa: F401

    COLLECTIVES.insert(0, "shm")
except ImportError:
    pass


def children(pid: int) -> list[int]:
    """Rank processes (cpud.ranks.worker) whose parent is `pid`."""
    return rank_pids(pid)


def thread_info(pid: int) -> dict[int, tuple[str, int]]:
    """tid -> (Cpus_allowed_list, utime+stime ticks)."""
    info = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        status = (task / "status").read_text()
        allowed = next(
            line.split(":")[1].strip()
            for line in status.splitlines()
            if line.startswith("Cpus_allowed_list")
        )
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        info[int(task.name)] = (allowed, int(fields[11]) + int(fields[12]))
    return info


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "opt"])
def test_tp2_tokens_equal_tp1(arch, collective, model_factory):
    model_dir = model_factory(arch)
    expected = [
        o.outputs[0].token_ids for o in LLM(model_dir, dtype="float32").generate(PROMPTS, GREEDY)
    ]
    with LLM(model_dir, dtype="float32", tp=2, bind="0|1", collective=collective) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == expected


def test_tp2_engine_leaves_the_callers_torch_threads(model_factory):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # not 1, whatever earlier tests left: the old bug set 1
    try:
        with LLM(model_factory("qwen3"), dtype="float32", tp=2, bind="0|1") as llm:
            llm.generate(PROMPTS[:1], GREEDY)
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_rank_threads_pinned_and_busy(model_factory):
    with LLM(
        model_factory("qwen3"), dtype="bfloat16", tp=2, bind="0|1", collective=COLLECTIVES[0]
    ) as llm:
        ready = llm.engine.executor.ready
        assert [r.thread_cpus for r in ready] == [[0], [1]]
        pids = [r.pid for r in ready]
        before = {pid: thread_info(pid) for pid in pids}
        llm.generate([list(range(5, 200))] * 4, SamplingParams(max_tokens=40, ignore_eos=True))
        for rank, pid in enumerate(pids):
            after = thread_info(pid)
            # Every thread of the rank may only run on the rank's core.
            assert {allowed for allowed, _ in after.values()} == {str(rank)}
            busy = [
                tid for tid, (_, ticks) in after.items() if ticks > before[pid].get(tid, ("", 0))[1]
            ]
            assert busy, f"no thread of rank {rank} did work"


def test_killed_rank_fails_the_generation_promptly(model_factory):
    llm = LLM(model_factory("qwen3"), dtype="float32", tp=2, bind="0|1")
    executor = llm.engine.executor
    pids = [r.pid for r in executor.ready]
    execute = executor.execute
    steps = []

    def execute_then_kill(plan):
        steps.append(plan.step_id)
        if len(steps) == 3:  # mid-generation: after prefill, during decode
            os.kill(pids[1], signal.SIGKILL)
        return execute(plan)

    executor.execute = execute_then_kill
    started = time.monotonic()
    with pytest.raises(RankDiedError, match="rank 1"):
        llm.generate([list(range(5, 60))] * 8, SamplingParams(max_tokens=200, ignore_eos=True))
    assert time.monotonic() - started < 10
    shut_down_after_a_lost_rank(llm, pids)
    assert not children(os.getpid())


def test_rank_that_raises_during_a_step_is_named(model_factory):
    """A step a rank cannot execute (here a block table past its KV cache) makes it report
    FAILED with the exception; the caller gets RankDiedError at once, and nothing is left."""
    import msgspec

    llm = LLM(model_factory("qwen3"), dtype="float32", tp=2, bind="0|1", num_kv_blocks=64)
    executor = llm.engine.executor
    pids = [r.pid for r in executor.ready]
    execute = executor.execute

    def execute_a_broken_plan(plan):
        seqs = [
            msgspec.structs.replace(s, block_ids=[10_000] * len(s.block_ids)) for s in plan.seqs
        ]
        return execute(msgspec.structs.replace(plan, seqs=seqs))

    executor.execute = execute_a_broken_plan
    started = time.monotonic()
    with pytest.raises(RankDiedError, match=r"rank \d failed: .*Error"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    assert time.monotonic() - started < 10
    shut_down_after_a_lost_rank(llm, pids)


def test_rank_that_finds_the_model_unusable_is_a_config_error(model_factory, tmp_path):
    import shutil

    model_dir = tmp_path / "broken"
    shutil.copytree(model_factory("llama"), model_dir)
    # config.json and the safetensors headers are each valid, but they disagree: only a rank
    # loading its weights finds out.
    config = json.loads((model_dir / "config.json").read_text())
    config["intermediate_size"] *= 2
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="config.json does not match the weights"):
        LLM(model_dir, dtype="float32", tp=2, bind="0|1", collective=COLLECTIVES[0])
    assert not children(os.getpid())


def test_missing_weights_are_refused_before_any_rank_starts(model_factory, tmp_path):
    import shutil

    model_dir = tmp_path / "no-weights"
    shutil.copytree(model_factory("llama"), model_dir)
    (model_dir / "model.safetensors").rename(model_dir / "weights.bin")
    with pytest.raises(ConfigError, match="no \\*.safetensors weights"):
        LLM(model_dir, dtype="float32", tp=2, bind="0|1", collective=COLLECTIVES[0])
    assert not children(os.getpid())


def test_rank_that_never_answers_is_named(model_factory, monkeypatch):
    from cpud.engine import multiproc
    from cpud.engine.rank_group import RankGroup, RankTimeouts

    original = RankGroup._spawn

    def spawn_then_stop_rank1(self, *args):
        original(self, *args)
        os.kill(self.procs[1].pid, signal.SIGSTOP)

    monkeypatch.setattr(RankGroup, "_spawn", spawn_then_stop_rank1)
    original_init = multiproc.MultiprocExecutor.__init__

    def short_timeout(self, config, slots, collective="shm", timeouts=None):
        original_init(self, config, slots, collective, RankTimeouts(ready=5.0))

    monkeypatch.setattr(multiproc.MultiprocExecutor, "__init__", short_timeout)
    started = time.monotonic()
    with pytest.raises(RankDiedError, match=r"rank\(s\) \[1\] did not report ready within 5 s"):
        LLM(model_factory("llama"), dtype="float32", tp=2, bind="0|1", collective=COLLECTIVES[0])
    assert time.monotonic() - started < 30
    assert not children(os.getpid())


def test_silent_rank_is_killed_and_named(model_factory, monkeypatch):
    """A rank that stops sending heartbeats (stopped, wedged) is declared lost, not waited on."""
    from cpud.engine import multiproc
    from cpud.engine.rank_group import RankTimeouts

    original_init = multiproc.MultiprocExecutor.__init__

    def short_silence(self, config, slots, collective="shm", timeouts=None):
        original_init(self, config, slots, collective, RankTimeouts(silent=3.0))

    monkeypatch.setattr(multiproc.MultiprocExecutor, "__init__", short_silence)
    llm = LLM(model_factory("qwen3"), dtype="float32", tp=2, bind="0|1")
    pids = [r.pid for r in llm.engine.executor.ready]
    os.kill(pids[1], signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(RankDiedError, match=r"rank 1 .* sent no heartbeat for \d+ s"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=400, ignore_eos=True))
    assert time.monotonic() - started < 10
    shut_down_after_a_lost_rank(llm, pids)


def test_hung_rank_during_a_step_is_reported(model_factory):
    llm = LLM(model_factory("qwen3"), dtype="float32", tp=2, bind="0|1", collective="gloo")
    executor = llm.engine.executor
    executor.client.step_timeout = 3.0
    pids = [r.pid for r in executor.ready]
    os.kill(pids[0], signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(RankDiedError, match="within 3 s: a rank is hung"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    assert time.monotonic() - started < 10
    shut_down_after_a_lost_rank(llm, pids)


def shut_down_after_a_lost_rank(llm: LLM, pids: list[int]) -> None:
    """A lost rank leaves nothing to finish: shutdown kills the ranks at once instead of
    waiting out the graceful stop's 10 s grace, and none survives."""
    started = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - started < 3
    time.sleep(0.2)
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids), "a rank survived"
