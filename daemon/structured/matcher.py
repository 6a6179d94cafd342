"""One sequence's place in its grammar: the tokens it may sample next, and advancing on the
token it did sample. Its state follows the sequence's output tokens, so recomputing a
preempted sequence changes nothing here."""

from __future__ import annotations

import llguidance

from cpud.settings.errors import RequestError, one_line

LIMIT_STOPS = ("LexerTooComplex", "ParserTooComplex")


class ConstraintViolation(RuntimeError):
    """A sampled token the grammar does not allow (the mask should have prevented it)."""


class GrammarLimitError(RequestError):
    """The request's grammar went past the server's grammar limits while generating: the
    grammar's fault, not the server's."""


class SequenceConstraint:
    def __init__(self, matcher: llguidance.LLMatcher, mask: bytes | None = None):
        """`mask`: the matcher's mask at its current state when already computed (the first
        mask is, off the engine thread, when the request is validated)."""
        self._matcher = matcher
        self._mask = mask
        self._consumed = 0

    def allowed_mask(self) -> bytes:
        """Packed bitmask over the tokenizer's vocabulary, bit t of byte t // 8 set (LSB
        first) when token t may come next; llguidance's 32-bit words in little-endian order.
        Computed once per state."""
        if self._mask is None:
            self._mask = self._matcher.compute_bitmask()
        return self._mask

    def advance(self, token_id: int) -> None:
        """Take the sampled token; ConstraintViolation when the grammar refuses it."""
        self._mask = None
        if not self._matcher.consume_token(token_id):
            error = self._matcher.get_error().replace("<non-verbose/>", "")
            problem = one_line(error, 300) or "no reason given"
            if self._matcher.stop_reason() in LIMIT_STOPS or error.startswith("lexer error"):
                raise GrammarLimitError(
                    f"the output grammar went past the server's grammar limits after "
                    f"{self._consumed} tokens: {problem}; simplify it"
                )
            raise ConstraintViolation(f"token {token_id} breaks the output grammar: {problem}")
        self._consumed += 1

    def draft_masks(self, draft: list[int]) -> tuple[list[int], list[bytes]]:
        """Speculative proposals checked against the grammar: the longest prefix of `draft`
        it takes without ending, and the mask at each position to verify (before the first
        kept proposal and after each: one more than kept). The state is left as it was."""
        masks = [self.allowed_mask()]
        kept: list[int] = []
        for token in draft[: self._matcher.validate_tokens(draft)]:
            self._matcher.consume_token(token)
            kept.append(token)
            if self._matcher.is_stopped():
                kept.pop()  # the grammar's end: the sequence finishes on it, nothing follows
                self._matcher.rollback(1)
                break
            masks.append(self._matcher.compute_bitmask())
        if kept:
            self._matcher.rollback(len(kept))
        return kept, masks

    @property
    def complete(self) -> bool:
        """Nothing can follow but end of sequence: the output is whole."""
        return self._matcher.is_stopped()


class StartedGrammar:
    """A compiled grammar at its start state with its first mask, both worked out before the
    request reaches the engine thread; shared (by the cache, by a request's choices), never
    advanced itself."""

    def __init__(self, matcher: llguidance.LLMatcher, first_mask: bytes):
        self._matcher = matcher
        self.first_mask = first_mask

    def matcher(self) -> llguidance.LLMatcher:
        """A fresh matcher at the start state."""
        return self._matcher.deep_copy()

    def constraint(self) -> SequenceConstraint:
        """A new sequence's constraint, its first mask already known."""
        return SequenceConstraint(self._matcher.deep_copy(), self.first_mask)
