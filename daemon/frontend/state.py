"""What the HTTP layer needs to serve: the engine, the tokenizer, the limits, the lifecycle."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from cpud.frontend.async_engine import AsyncEngine
from cpud.frontend.metrics import FrontendMetrics
from cpud.tokenizer import Tokenizer


class Phase(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"


@dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...]
    max_model_len: int
    api_key: str | None = None
    metrics_need_key: bool = False
    max_body_bytes: int = 4 << 20
    max_prompts: int = 64


class ServerState:
    """Changes only by `attach` (the engine is loaded) and `phase` (the lifecycle)."""

    def __init__(self, config: ServerConfig, tokenizer: Tokenizer):
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = FrontendMetrics()
        self.phase = Phase.LOADING
        self._engine: AsyncEngine | None = None

    def attach(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self.metrics.watch(engine)
        self.phase = Phase.READY

    @property
    def engine(self) -> AsyncEngine:
        if self._engine is None:
            raise RuntimeError("the engine is not loaded yet")
        return self._engine

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet finished (0 before the engine is loaded)."""
        return 0 if self._engine is None else self._engine.num_unfinished

    @property
    def engine_alive(self) -> bool:
        return self._engine is not None and self._engine.alive

    @property
    def model_name(self) -> str:
        return self.config.served_model_names[0]
