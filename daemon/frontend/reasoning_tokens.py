"""How many of an output's tokens are reasoning (usage's `reasoning_tokens`): each token is
read, by its own text, through a fresh reasoning parser of the request's format, and counts
when the parser is inside the reasoning before or after it. So a think block counts whole,
`<think>` and `</think>` included, and a harmony analysis message from its `<|message|>` to
its `<|end|>`. Streamed and whole answers count the same tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cpud.frontend.reasoning import ReasoningPlan, new_parser


class ReasoningTokenCounter:
    def __init__(self, plan: ReasoningPlan, decode: Callable[[int], str]):
        self.parser = new_parser(plan)
        self.decode = decode  # one token's text, special tokens kept
        self.count = 0

    def feed(self, token_ids: Sequence[int]) -> int:
        """Read the output's next tokens; the count so far."""
        for token in token_ids:
            before = self.parser.in_reasoning
            self.parser.feed(self.decode(token))
            self.count += before or self.parser.in_reasoning
        return self.count


def reasoning_token_count(
    plan: ReasoningPlan | None, token_ids: Sequence[int], decode: Callable[[int], str]
) -> int:
    """The reasoning tokens of a whole output (0 when the request splits off none)."""
    return 0 if plan is None else ReasoningTokenCounter(plan, decode).feed(token_ids)
