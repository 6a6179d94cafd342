"""Results handed to users, shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

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
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
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
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Prompt tokens served from the prefix cache when the request was admitted (its first
    # choice's count with n > 1): usage.prompt_tokens_details.cached_tokens.
    num_cached_tokens: int = 0
