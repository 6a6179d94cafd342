"""What the HTTP layer needs to serve: the engine, the tokenizer, the limits, the lifecycle."""

from __future__ import annotations

import asyncio
import enum
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from cpud.frontend.async_engine import AsyncEngine
from cpud.frontend.errors import APIError
from cpud.frontend.lifecycle import Lifecycle
from cpud.frontend.metrics import FrontendMetrics
from cpud.frontend.pacing import BodyPacer
from cpud.text.tokenizer import Tokenizer

T = TypeVar("T")
WORKER_NICE = 10


def yield_cpu() -> None:
    """Tokenizer threads run below the ranks' priority (Linux nice is per thread): a burst
    of long prompts slows its own senders, not the steps of running streams."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICE)
    except OSError:
        pass


class Phase(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"


@dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...]
    max_model_len: int
    api_key: str | None = field(default=None, repr=False)
    metrics_need_key: bool = False
    max_body_bytes: int = 4 << 20
    max_prompts: int = 64
    max_embedding_inputs: int = 2048  # OpenAI's limit (within --max-pending-requests)
    # /health answers 503 once work has waited this long for a step to finish
    stall_seconds: float = 10.0
    tokenize_threads: int = 2
    # Bodies are read at full speed up to paced_body_bytes; beyond, at this rate for all
    # clients together (a lone 1 MiB prompt waits ~12 ms) and at most paced_bodies at once.
    paced_body_bytes: int = 256 << 10
    body_bytes_per_s: float = 64 << 20
    paced_bodies: int = 2
    body_seconds: float = 60.0  # a body still arriving after this is a 408
    max_tokenizing: int = 256  # requests queued for the tokenizer threads before 429
    tool_call_parser: str | None = None  # None: detected from the chat template
    reasoning_parser: str | None = None  # None: detected from the chat template
    prompt_tokens_details: bool = True  # usage reports cached_tokens
    replica: int | None = None  # a data-parallel replica's index: its metrics' label


class ServerState:
    """Changes only by `attach` (the engine is loaded) and `phase` (the lifecycle)."""

    def __init__(self, config: ServerConfig, tokenizer: Tokenizer):
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = FrontendMetrics(config.replica)
        self.phase = Phase.LOADING
        self.lifecycle = Lifecycle()
        self._engine: AsyncEngine | None = None
        # A text of more characters needs more tokens than the context holds: no token of the
        # vocabulary decodes to more than max_token_bytes bytes, nor a character to fewer than 1.
        self.max_prompt_chars = config.max_model_len * tokenizer.max_token_bytes()
        self._blocking = ThreadPoolExecutor(
            config.tokenize_threads, thread_name_prefix="cpud-tokenize", initializer=yield_cpu
        )
        self._tokenizing = 0
        self.body_pacer = BodyPacer(
            config.body_bytes_per_s, config.paced_body_bytes, config.paced_bodies
        )

    async def off_loop(self, fn: Callable[..., T], *args: object) -> T:
        """Run tokenizing and templating on the frontend's worker threads, so that one large
        prompt delays its own request, not the event loop; 429 once too many wait for them."""
        if self._tokenizing >= self.config.max_tokenizing:
            raise APIError(
                429,
                f"{self._tokenizing} requests are waiting to be tokenized; retry shortly",
                "rate_limit_error",
                None,
                "queue_full",
                {"Retry-After": "1"},
            )
        self._tokenizing += 1
        try:
            work = asyncio.get_running_loop().run_in_executor(self._blocking, fn, *args)
            return await self.lifecycle.before_admission(work)
        finally:
            self._tokenizing -= 1

    def close(self) -> None:
        self._blocking.shutdown(wait=False, cancel_futures=True)

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
    def stalled_seconds(self) -> float:
        """How long queued work has waited for a step to finish (0 while idle or loading)."""
        return 0.0 if self._engine is None else self._engine.seconds_without_progress()

    @property
    def model_name(self) -> str:
        return self.config.served_model_names[0]
