"""Results handed to users, shaped like vLLM's RequestOutput / CompletionOutput.

The outputs of a running request are cumulative; their token ids and logprobs are Snapshots
of the engine's growing lists (made in constant time), the outputs of a finished request hold
plain lists."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import TypeVar, overload

T = TypeVar("T")


class Snapshot(Sequence[T]):
    """items[start:stop] of a list that only grows at its end, without copying it: what the
    list held when the snapshot was made, however it grows later. Read-only; slicing gives
    lists, and a snapshot equals the list of the same items."""

    __slots__ = ("_items", "_start", "_stop")

    def __init__(self, items: list[T], start: int = 0, stop: int | None = None):
        self._items = items
        self._start = start
        self._stop = len(items) if stop is None else stop

    def __len__(self) -> int:
        return self._stop - self._start

    @overload
    def __getitem__(self, index: int) -> T: ...

    @overload
    def __getitem__(self, index: slice) -> list[T]: ...

    def __getitem__(self, index: int | slice) -> T | list[T]:
        size = len(self)
        if isinstance(index, slice):
            first, last, step = index.indices(size)
            if step == 1:
                return self._items[self._start + first : self._start + max(first, last)]
            return [self._items[self._start + i] for i in range(first, last, step)]
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError("snapshot index out of range")
        return self._items[self._start + index]

    def __iter__(self) -> Iterator[T]:
        return islice(self._items, self._start, self._stop)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (list, Snapshot)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(list(self))


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: Sequence[int]
    cumulative_logprob: float | None
    logprobs: Sequence[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)
    # None at the first token (nothing precedes it), then the prompt token's logprob and the
    # top alternatives at each position; set when the request asked for prompt_logprobs.
    prompt_logprobs: Sequence[dict[int, Logprob] | None] | None = None
    # Prompt tokens served from the prefix cache when the request was admitted (its first
    # choice's count with n > 1): usage.prompt_tokens_details.cached_tokens.
    num_cached_tokens: int = 0


@dataclass
class EmbeddingOutput:
    """One input's pooled vector, shaped like vLLM's EmbeddingOutput."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """The result of one embedding request, shaped like vLLM's EmbeddingRequestOutput."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
