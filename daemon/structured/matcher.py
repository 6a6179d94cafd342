"""One sequence's place in its grammar: the tokens it may sample next, and advancing on the
token it did sample. Its state follows the sequence's output tokens, so recomputing a
preempted sequence changes nothing here."""

from __future__ import annotations

import llguidance

from cpud.errors import one_line


class ConstraintViolation(RuntimeError):
    """A sampled token the grammar does not allow (the mask should have prevented it)."""


class SequenceConstraint:
    def __init__(self, matcher: llguidance.LLMatcher):
        self._matcher = matcher

    def allowed_mask(self) -> bytes:
        """Packed bitmask over the tokenizer's vocabulary, bit t of byte t // 8 set (LSB
        first) when token t may come next; llguidance's 32-bit words in little-endian order."""
        return self._matcher.compute_bitmask()

    def advance(self, token_id: int) -> None:
        """Take the sampled token; ConstraintViolation when the grammar refuses it."""
        if not self._matcher.consume_token(token_id):
            problem = one_line(self._matcher.get_error(), 300) or "no reason given"
            raise ConstraintViolation(f"token {token_id} breaks the output grammar: {problem}")

    @property
    def complete(self) -> bool:
        """Nothing can follow but end of sequence: the output is whole."""
        return self._matcher.is_stopped()
