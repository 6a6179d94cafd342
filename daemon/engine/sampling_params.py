"""User-facing sampling parameters, validated once at construction."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable
from dataclasses import dataclass

from cpud.settings.errors import RequestError
from cpud.structured.spec import StructuredSpec

MAX_LOGPROBS = 20
MAX_N = 128  # as OpenAI; the request's sequences must also fit the KV cache together
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 4096
MAX_STOP_TOKEN_IDS = 1024
TOKEN_ID_LIMIT = 2**31  # token ids and token counts fit in int32
MAX_COUNT = TOKEN_ID_LIMIT - 1
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
LOGIT_BIAS_LIMIT = 100.0  # |bias|, as OpenAI: -100 bans a token, +100 all but forces it
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # int64, as vLLM and torch take seeds
FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


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
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Output constraint (response_format, guided_*, tool_choice); compiled by cpud.structured.
    structured: StructuredSpec | None = None
    # OpenAI logit_bias: token id -> bias added to its logit before sampling, in [-100, 100],
    # at most 300 entries. A {token id: bias} dict is accepted (keys may be decimal strings, as
    # in JSON) and kept as (id, bias) pairs sorted by id. Ids are checked against the model's
    # vocabulary when the engine admits the request.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's cache_salt: requests share prefix-cache blocks only with requests of the same salt
    # (a tenant's secret keeps others from learning, by cache hits, what it sent).
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self._coerce()
        self._validate()

    def _coerce(self) -> None:
        """Numbers as plain ints and floats (numpy scalars welcome); anything else is refused.
        Messages never print the value: a huge integer has no cheap decimal form."""

        def integer(param: str, value: object) -> int:
            if isinstance(value, bool):
                raise RequestError(f"{param} must be an integer, not a bool", param=param)
            try:
                return operator.index(value)
            except TypeError:
                raise RequestError(
                    f"{param} must be an integer, got {type(value).__name__}", param=param
                ) from None

        def real(param: str, value: object) -> float:
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise RequestError(
                    f"{param} must be a number, got {type(value).__name__}", param=param
                )
            try:
                result = float(value)
            except OverflowError:
                result = math.inf
            if not math.isfinite(result):
                raise RequestError(f"{param} must be a finite number", param=param)
            return result

        for name in ("n", "top_k", "min_tokens"):
            object.__setattr__(self, name, integer(name, getattr(self, name)))
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, integer(name, getattr(self, name)))
        ids = tuple(integer("stop_token_ids", t) for t in self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", ids)
        for name in FLOAT_FIELDS:
            object.__setattr__(self, name, real(name, getattr(self, name)))
        object.__setattr__(self, "logit_bias", self._coerce_logit_bias(integer, real))
        if self.structured is not None and not isinstance(self.structured, StructuredSpec):
            raise RequestError(
                f"structured must be a StructuredSpec, got {type(self.structured).__name__}",
                param="structured",
            )

    def _coerce_logit_bias(
        self, integer: Callable[[str, object], int], real: Callable[[str, object], float]
    ) -> tuple[tuple[int, float], ...]:
        param = "logit_bias"
        entries = self.logit_bias
        if entries is None:
            return ()
        if isinstance(entries, dict):
            entries = tuple(entries.items())
        elif isinstance(entries, (str, bytes)):
            raise RequestError(f"{param} must map token ids to numbers", param=param)
        try:
            pairs = list(entries)
        except TypeError:
            raise RequestError(f"{param} must map token ids to numbers", param=param) from None
        if len(pairs) > MAX_LOGIT_BIAS:
            raise RequestError(
                f"{param} allows at most {MAX_LOGIT_BIAS} entries, got {len(pairs)}", param=param
            )
        biases: dict[int, float] = {}
        for pair in pairs:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise RequestError(f"{param} must map token ids to numbers", param=param)
            key, value = pair
            if isinstance(key, str):
                text = key.strip()
                if not text.isdigit() or not text.isascii():
                    raise RequestError(
                        f"{param} keys must be token ids (decimal integers)", param=param
                    )
                key = int(text)
            token = integer(param, key)
            if not 0 <= token < TOKEN_ID_LIMIT:
                raise RequestError(f"{param} keys must be token ids, >= 0", param=param)
            if token in biases:
                raise RequestError(f"{param} names token {token} twice", param=param)
            bias = real(param, value)
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise RequestError(
                    f"{param} values must be between -100 and 100 (token {token}: {bias:g})",
                    param=param,
                )
            biases[token] = bias
        return tuple(sorted(biases.items()))

    def _validate(self) -> None:
        def fail(param: str, message: str) -> None:
            raise RequestError(f"{param} {message}", param=param)

        if not 1 <= self.n <= MAX_N:
            fail("n", f"must be between 1 and {MAX_N}")
        if not 0.0 <= self.temperature <= 100.0:
            fail("temperature", f"must be between 0 and 100, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if not -1 <= self.top_k <= MAX_COUNT:
            fail("top_k", f"must be -1 or 0 (disabled) or a count up to {MAX_COUNT}")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", f"must be between 0 and 1, got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            fail("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", f"must be between -2 and 2, got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", f"must be between -2 and 2, got {self.frequency_penalty}")
        if self.max_tokens is not None and not 1 <= self.max_tokens <= MAX_COUNT:
            fail("max_tokens", f"must be between 1 and {MAX_COUNT}")
        if not 0 <= self.min_tokens <= MAX_COUNT:
            fail("min_tokens", f"must be between 0 and {MAX_COUNT}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(
                "min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            fail("logprobs", f"must be between 0 and {MAX_LOGPROBS}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            fail("prompt_logprobs", f"must be between 0 and {MAX_LOGPROBS}")
        if len(self.stop) > MAX_STOP_STRINGS:
            fail("stop", f"allows at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            fail("stop", "entries must be non-empty strings")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            fail("stop", f"entries must be at most {MAX_STOP_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            fail("stop_token_ids", f"allows at most {MAX_STOP_TOKEN_IDS} ids")
        if any(not 0 <= t < TOKEN_ID_LIMIT for t in self.stop_token_ids):
            fail("stop_token_ids", f"entries must be token ids in [0, {TOKEN_ID_LIMIT})")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            fail("seed", f"must be between {SEED_MIN} and {SEED_MAX} (a signed 64-bit integer)")
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str) or not self.cache_salt
        ):
            fail("cache_salt", "must be a non-empty string")

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
