"""Where step plans run. tp=1 runs the model in this process; the multi-process daemon
provides an executor with the same two methods over ZeroMQ."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from cpud.protocol.control import RankStats
from cpud.protocol.launch import RankSlot
from cpud.protocol.step import StepPlan, StepResult
from cpud.settings.config import EngineConfig

if TYPE_CHECKING:
    from cpud.ranks.model_runner import RunnerConfig


class Executor(Protocol):
    def execute(self, plan: StepPlan) -> StepResult: ...

    def check_health(self) -> None:
        """Raise if the executor can no longer run steps (called while idle)."""
        ...

    def rank_stats(self) -> list[RankStats]:
        """The latest counters of every rank (for metrics)."""
        ...

    def shutdown(self) -> None: ...


def runner_config(config: EngineConfig) -> RunnerConfig:
    from cpud.ranks.worker import runner_config as from_spec

    return from_spec(config.spec())


class InProcessExecutor:
    def __init__(self, config: EngineConfig):
        import os

        from cpud.ranks.model_runner import ModelRunner
        from cpud.ranks.parallel import SingleRank
        from cpud.ranks.stats import RankStatsCollector

        self.runner = ModelRunner(runner_config(config), config.model, SingleRank())
        cpus = sorted(os.sched_getaffinity(0))
        self.stats = RankStatsCollector(0, None, cpus, 0)

    def execute(self, plan: StepPlan) -> StepResult:
        result = self.runner.execute(plan)
        assert result is not None, "a single rank always returns its result"
        self.stats.observe_step(result.forward_seconds)
        return result

    def check_health(self) -> None:
        return None

    def rank_stats(self) -> list[RankStats]:
        return [self.stats.snapshot(None, self.runner.kv_cache_bytes)]

    def shutdown(self) -> None:
        self.runner = None


def make_executor(config: EngineConfig, slots: list[RankSlot]) -> Executor:
    """In-process at tp=1; otherwise one bound rank process per slot (placement.start plans
    the slots and checks the memory first)."""
    if config.tp == 1:
        return InProcessExecutor(config)
    from cpud.engine.multiproc import MultiprocExecutor

    # The caller's torch thread count is its own: cpud's frontend sets 1 at its start, an
    # offline LLM(tp=2) leaves the user's process as it was (a TP=1 engine beside it keeps
    # its threads).
    return MultiprocExecutor(config, slots, config.collective)
