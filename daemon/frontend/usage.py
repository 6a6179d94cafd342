"""The `usage` object of OpenAI's chat and completion answers (whole, and in streams)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    details: bool = True  # prompt_tokens_details (--no-enable-prompt-tokens-details: left out)
    # completion_tokens_details.reasoning_tokens; None (left out): the output has no reasoning
    # split off (not a chat answer, no reasoning parser, reasoning turned off)
    reasoning_tokens: int | None = None

    def as_dict(self) -> dict:
        usage: dict = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if self.details:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        if self.reasoning_tokens is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return usage
