"""Results handed to users, shaped like vLLM's RequestOutput / CompletionOutput.

The engine's step hands out deltas (vLLM's RequestOutputKind.DELTA): each RequestOutput holds,
per choice with news, the token ids, text and logprob entries that are new since the
request's previous output. OutputAccumulator folds a request's deltas into the whole output
(what the offline LLM API and non-streaming answers return), joining the text once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


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


class _Choice:
    """One choice's deltas so far: text in pieces, token ids and logprob entries in lists."""

    __slots__ = ("pieces", "token_ids", "logprobs", "last")

    def __init__(self, first: CompletionOutput):
        self.pieces: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = None
        self.last = first

    def add(self, delta: CompletionOutput) -> None:
        if delta.text:
            self.pieces.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        self.last = delta

    def whole(self) -> CompletionOutput:
        last = self.last
        if len(self.pieces) > 1:
            self.pieces = ["".join(self.pieces)]
        return CompletionOutput(
            index=last.index,
            text=self.pieces[0] if self.pieces else "",
            token_ids=list(self.token_ids),
            cumulative_logprob=last.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=last.finish_reason,
            stop_reason=last.stop_reason,
        )


class OutputAccumulator:
    """Folds one request's delta outputs into its whole output: each delta costs work in
    proportion to its own size; `result` joins the text (once, at the end, is the intent)."""

    def __init__(self) -> None:
        self._choices: dict[int, _Choice] = {}
        self._last: RequestOutput | None = None

    def add(self, delta: RequestOutput) -> None:
        for out in delta.outputs:
            choice = self._choices.get(out.index)
            if choice is None:
                choice = self._choices[out.index] = _Choice(out)
            choice.add(out)
        self._last = delta

    @property
    def finished(self) -> bool:
        return self._last is not None and self._last.finished

    def result(self) -> RequestOutput:
        """The request's output so far, whole: every choice's text, token ids and logprobs."""
        last = self._last
        if last is None:
            raise ValueError("no output has been added")
        return RequestOutput(
            last.request_id,
            last.prompt,
            last.prompt_token_ids,
            [self._choices[i].whole() for i in sorted(self._choices)],
            last.finished,
            metrics=last.metrics,
            prompt_logprobs=last.prompt_logprobs,
            num_cached_tokens=last.num_cached_tokens,
        )


def accumulate(outputs: Sequence[RequestOutput]) -> RequestOutput:
    """The whole output of one request's deltas, in order."""
    acc = OutputAccumulator()
    for delta in outputs:
        acc.add(delta)
    return acc.result()
