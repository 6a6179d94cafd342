"""Megatron sharding of every layer, checked in one process: N model shards run in threads
joined by a barrier-based all-reduce, and must give the logits of the unsharded model."""

from __future__ import annotations

import threading

import pytest
import torch

from cpud.model.load import load_model_config
from cpud.protocol.step import SeqWork, StepPlan
from cpud.ranks.model_runner import ModelRunner, RunnerConfig
from cpud.ranks.parallel import SingleRank


class ThreadGroupHub:
    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size)
        self.slots: list[torch.Tensor | None] = [None] * size


class ThreadRank:
    """One rank of an in-process group; collectives meet at the hub's barrier."""

    def __init__(self, hub: ThreadGroupHub, rank: int):
        self.hub = hub
        self.rank = rank
        self.size = hub.size

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.hub.slots[self.rank] = tensor
        self.hub.barrier.wait()
        parts = list(self.hub.slots)
        self.hub.barrier.wait()
        return parts

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(tensor.clone())
        tensor.copy_(torch.stack(parts).sum(0))
        return tensor

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor | None:
        parts = self._exchange(tensor)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None


def run_ranks(hub: ThreadGroupHub, calls: list, *args) -> list:
    """Each rank's call(*args) on its own thread, meeting at the hub; their results by rank
    (a failure on any thread aborts the barrier and fails the test)."""
    results: list = [None] * len(calls)
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = calls[rank](*args)
        except BaseException as exc:  # surface thread failures in the test
            errors.append(exc)
            hub.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return results


def runner_config(model_dir) -> RunnerConfig:
    return RunnerConfig(model_dir, torch.float32, 256, 16, 16)


def logits_with(model_dir, prompt: list[int], tp: int) -> torch.Tensor:
    cfg = load_model_config(model_dir)
    plan = StepPlan(0, [SeqWork(0, prompt, 0, list(range(-(-len(prompt) // 16))), False)])
    if tp == 1:
        return ModelRunner(runner_config(model_dir), cfg, SingleRank()).prompt_logits(plan)
    hub = ThreadGroupHub(tp)
    runners = [ModelRunner(runner_config(model_dir), cfg, ThreadRank(hub, r)) for r in range(tp)]
    results = run_ranks(hub, [runner.prompt_logits for runner in runners], plan)
    assert all(r is None for r in results[1:]), "only rank 0 receives logits"
    return results[0]


@pytest.mark.parametrize(
    "arch,tp",
    [("llama", 2), ("mistral", 2), ("qwen3", 2), ("opt", 2), ("qwen2", 2), ("qwen2", 4)],
)
def test_sharded_logits_equal_unsharded(arch, tp, model_factory):
    model_dir = model_factory(arch)
    prompt = [(13 * i) % 400 + 5 for i in range(37)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        full = logits_with(model_dir, prompt, 1)
        sharded = logits_with(model_dir, prompt, tp)
    finally:
        torch.set_num_threads(threads)
    assert sharded.shape == full.shape
    torch.testing.assert_close(sharded, full, rtol=1e-4, atol=1e-4 * float(full.std()))


def test_kv_heads_replicate_when_tp_exceeds_them(model_factory):
    # qwen2 tiny: 8 query heads over 2 KV heads; tp=4 gives each rank 2 q heads and 1 KV head.
    from cpud.ranks.models.build import build_model

    cfg = load_model_config(model_factory("qwen2"))
    hub = ThreadGroupHub(4)
    model = build_model(cfg, 64, torch.float32, ThreadRank(hub, 3))
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.num_heads_local == cfg.num_heads // 4
    assert qkv.num_kv_heads_local == 1 and qkv.kv_replicas == 2


def test_tp_that_does_not_divide_heads_is_a_clear_error(model_factory):
    from cpud.ranks.models.build import build_model
    from cpud.settings.errors import ConfigError

    cfg = load_model_config(model_factory("llama"))
    with pytest.raises(ConfigError, match="not divisible by the tensor-parallel size 3"):
        build_model(cfg, 64, torch.float32, ThreadRank(ThreadGroupHub(3), 0))
