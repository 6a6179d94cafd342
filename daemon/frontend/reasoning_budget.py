"""A cap on a request's reasoning tokens (vLLM's `thinking_token_budget`, Anthropic's
`thinking.budget_tokens`): once the reasoning has used its budget, the engine is made to write
the tokens that close it (`</think>` for think blocks; for harmony `<|end|>` and the header of a
final message), and the model goes on with its answer.

It rides on the engine's output-constraint slot (an Admission's grammar: a request with an
output grammar has no reasoning to cap): each sequence counts its reasoning tokens as usage
counts them (reasoning_tokens.py), leaves the sampler free while under budget, and allows
only the next closing token while it closes. So usage's reasoning_tokens comes to the budget,
closing tokens included (more only when the closing tags alone exceed it)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

from cpud.frontend.harmony import CHANNEL, END, MESSAGE, START
from cpud.frontend.reasoning import HARMONY, ReasoningPlan
from cpud.frontend.reasoning_split import ReasoningParser
from cpud.frontend.reasoning_think import THINK_CLOSE
from cpud.frontend.reasoning_tokens import ReasoningTokenCounter

HARMONY_FINAL = f"{START}assistant{CHANNEL}final{MESSAGE}"


def one_token_mask(token: int) -> bytes:
    """The packed allowed-token mask (bit t of byte t // 8, LSB first) allowing only `token`."""
    mask = bytearray(token // 8 + 1)
    mask[token // 8] = 1 << (token % 8)
    return bytes(mask)


@dataclass(frozen=True)
class ReasoningBudget:
    """One request's cap, shared by its sequences (each starts its own `constraint()`)."""

    plan: ReasoningPlan
    budget: int
    close: tuple[int, ...]  # the tokens that close the reasoning
    close_counted: int  # how many of them count as reasoning
    decode: Callable[[int], str]  # one token's text, special tokens kept

    def constraint(self) -> BudgetConstraint:
        return BudgetConstraint(self)


def reasoning_budget(
    plan: ReasoningPlan,
    budget: int,
    encode: Callable[[str], list[int]],
    decode: Callable[[int], str],
) -> ReasoningBudget:
    """The cap for outputs read by `plan`, with the tokenizer's `encode` (no special tokens
    added) and one-token `decode`."""
    if plan.parser == HARMONY:
        closing, counted = END + HARMONY_FINAL, END
    else:
        closing = counted = THINK_CLOSE
    close = tuple(encode(closing))
    return ReasoningBudget(plan, budget, close, len(encode(counted)), decode)


class BudgetConstraint:
    """A sequence's reasoning count and, once at the budget, the closing tokens still to
    write; the engine's constraint interface (SequenceConstraint's)."""

    complete = False  # never ends the output itself

    def __init__(self, budget: ReasoningBudget):
        self.budget = budget
        self.counter = ReasoningTokenCounter(budget.plan, budget.decode)
        self.forced: list[int] = []
        self._close_if_spent()

    def _spent(self, parser: ReasoningParser, count: int) -> bool:
        return parser.in_reasoning and count + self.budget.close_counted >= self.budget.budget

    def _close_if_spent(self) -> None:
        if not self.forced and self._spent(self.counter.parser, self.counter.count):
            self.forced = list(self.budget.close)

    def allowed_mask(self) -> bytes:
        return one_token_mask(self.forced[0]) if self.forced else b""

    def advance(self, token_id: int) -> None:
        if self.forced:
            self.forced.pop(0)  # the mask allowed nothing else
        self.counter.feed([token_id])
        self._close_if_spent()

    def draft_masks(self, draft: list[int]) -> tuple[list[int], list[bytes]]:
        """Speculative proposals kept up to the one that spends the budget, and the mask at
        each position to verify (one more than kept); the state is left as it was."""
        masks = [self.allowed_mask()]
        if self.forced:
            return [], masks
        parser = copy.deepcopy(self.counter.parser)
        count, kept = self.counter.count, []
        for token in draft:
            before = parser.in_reasoning
            parser.feed(self.budget.decode(token))
            count += before or parser.in_reasoning
            kept.append(token)
            if self._spent(parser, count):
                masks.append(one_token_mask(self.budget.close[0]))
                break
            masks.append(b"")
        return kept, masks
