"""User-facing sampling parameters, validated once at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from cpud.errors import RequestError

MAX_LOGPROBS = 20
MAX_N = 16
MAX_STOP_STRINGS = 16


@dataclass(frozen=True)
class SamplingParams:
    """Shaped like vLLM's SamplingParams; temperature 0 means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        def fail(param: str, message: str) -> None:
            raise RequestError(f"{param} {message}", param=param)

        def finite(param: str, value: float) -> None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                fail(param, f"must be a number, got {type(value).__name__}")
            if not math.isfinite(value):
                fail(param, f"must be finite, got {value}")

        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            finite(name, getattr(self, name))
        if not 1 <= self.n <= MAX_N:
            fail("n", f"must be between 1 and {MAX_N}, got {self.n}")
        if not 0.0 <= self.temperature <= 100.0:
            fail("temperature", f"must be between 0 and 100, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 and self.top_k != -1:
            fail("top_k", f"must be 0 or -1 (disabled) or a positive count, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", f"must be between 0 and 1, got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            fail("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", f"must be between -2 and 2, got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", f"must be between -2 and 2, got {self.frequency_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            fail("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            fail("min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(
                "min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            fail("logprobs", f"must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if len(self.stop) > MAX_STOP_STRINGS:
            fail("stop", f"allows at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            fail("stop", "entries must be non-empty strings")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            fail("seed", "must fit in 64 bits")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
