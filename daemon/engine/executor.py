"""Where step plans run. tp=1 runs the model in this process; the multi-process daemon
provides an executor with the same two methods over ZeroMQ."""

from __future__ import annotations

from typing import Protocol

from cpud.config import EngineConfig
from cpud.protocol.step import StepPlan, StepResult
from cpud.ranks.model_runner import ModelRunner, RunnerConfig
from cpud.ranks.parallel import SingleRank


class Executor(Protocol):
    def execute(self, plan: StepPlan) -> StepResult: ...

    def shutdown(self) -> None: ...


def runner_config(config: EngineConfig) -> RunnerConfig:
    return RunnerConfig(
        model_dir=config.model_dir,
        dtype=config.dtype,
        max_model_len=config.max_model_len,
        block_size=config.block_size,
        num_kv_blocks=config.num_kv_blocks,
        seed=config.seed,
        kernels=config.kernels,
    )


class InProcessExecutor:
    def __init__(self, config: EngineConfig):
        self.runner = ModelRunner(runner_config(config), config.model, SingleRank())

    def execute(self, plan: StepPlan) -> StepResult:
        result = self.runner.execute(plan)
        assert result is not None, "a single rank always returns its result"
        return result

    def shutdown(self) -> None:
        self.runner = None
