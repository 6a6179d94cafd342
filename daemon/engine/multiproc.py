"""The offline engine's ranks: this process owns them (the daemon's supervisor does that job
when serving). A private 0700 runtime directory holds the IPC sockets and the shared memory
segment; READY from every rank is awaited (any rank that fails or never answers is named),
then plans run in lockstep. Ranks die with their parent (PR_SET_PDEATHSIG), so no orphan
survives any exit path."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from cpud.config import EngineConfig
from cpud.engine.rank_client import RankClient
from cpud.engine.rank_group import (
    RankDiedError,
    RankEngineConfig,
    RankGroup,
    RankSlot,
    RankTimeouts,
)
from cpud.errors import ConfigError
from cpud.protocol.control import RankStats
from cpud.protocol.step import StepPlan, StepResult
from cpud.ranks.model_config import load_model_config

if TYPE_CHECKING:
    from cpud.ranks.model_runner import ModelRunner

__all__ = ["MultiprocExecutor", "RankDiedError", "RankSlot", "build_runner", "rank_engine_config"]


def rank_engine_config(config: EngineConfig) -> RankEngineConfig:
    return RankEngineConfig(
        model_dir=str(config.model_dir),
        dtype=config.dtype,
        max_model_len=config.max_model_len,
        block_size=config.block_size,
        num_kv_blocks=config.num_kv_blocks,
        seed=config.seed,
        kernels=config.kernels,
        weight_cache=config.weight_cache,
        kv_pretouch=config.kv_pretouch,
    )


def build_runner(
    config: RankEngineConfig, group: object, progress: Callable[[int, int], None] | None = None
) -> ModelRunner:
    from cpud.ranks.model_runner import ModelRunner

    return ModelRunner(config.runner_config(), load_model_config(config.model_dir), group, progress)


def runtime_parent() -> str:
    return os.environ.get("RUNTIME_DIRECTORY") or os.environ.get("XDG_RUNTIME_DIR") or "/tmp"


def make_runtime_dir() -> str:
    path = tempfile.mkdtemp(prefix="cpud-", dir=runtime_parent())
    os.chmod(path, 0o700)
    return path


class MultiprocExecutor:
    def __init__(
        self,
        config: EngineConfig,
        slots: list[RankSlot],
        collective: str = "shm",
        timeouts: RankTimeouts | None = None,
    ):
        if len(slots) != config.tp:
            raise ConfigError(f"{len(slots)} rank placements for tp={config.tp}")
        timeouts = timeouts or RankTimeouts()
        self.runtime_dir = make_runtime_dir()
        self.ctx = zmq.Context()
        self.group: RankGroup | None = None
        self.client: RankClient | None = None
        try:
            self.group = RankGroup(
                self.ctx, self.runtime_dir, rank_engine_config(config), slots, collective, timeouts
            )
            self.ready = self.group.wait_ready()
            self.client = RankClient(
                self.ctx, self.runtime_dir, config.tp, self.group.poll, timeouts.step
            )
        except BaseException:
            self.shutdown()
            raise

    def execute(self, plan: StepPlan) -> StepResult:
        return self.client.execute(plan)

    def check_health(self) -> None:
        self.client.check_health()

    def rank_stats(self) -> list[RankStats]:
        return self.client.rank_stats()

    def shutdown(self) -> None:
        if self.ctx.closed:
            return
        if self.client is not None:
            self.client.shutdown()
        if self.group is not None:
            self.group.stop()
        self.ctx.term()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
