"""A proposer for speculative-decoding tests that knows each prompt's greedy continuation and
proposes it with a wrong token at a varying position, so verification sees every accepted
length from 0 to k (the n-gram lookup on a random-weight fixture is rarely right)."""

from __future__ import annotations

from collections.abc import Sequence


class OracleIndex:
    def __init__(self, continuations: dict[tuple[int, ...], list[int]], vocab: int) -> None:
        self.continuations = continuations
        self.vocab = vocab

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        for prompt, output in self.continuations.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                if list(tokens[len(prompt) :]) != output[:done]:
                    return []  # the sequence went elsewhere (sampling): no guess
                draft = list(output[done : done + k])
                wrong = len(tokens) % (k + 2)  # k or k + 1: all right
                if wrong < len(draft):
                    draft[wrong] = (draft[wrong] + 1) % self.vocab
                return draft
        return []


def use_oracle(monkeypatch, continuations: dict[tuple[int, ...], list[int]], vocab: int) -> None:
    """Every speculating sequence proposes from `continuations` instead of n-gram lookup."""
    from cpud.engine import spec_decode

    oracle = OracleIndex(continuations, vocab)
    monkeypatch.setattr(spec_decode, "NgramIndex", lambda n_min, n_max: oracle)
