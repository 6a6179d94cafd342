"""N-gram prompt lookup: propose the tokens that followed an earlier occurrence of the
sequence's last n tokens (prompt and output so far), the longest n in [n_min, n_max] first.

Of that n-gram's occurrences, the first at or after the point the last match's source has
reached by now (its position then plus the tokens gained since) wins: a rewrite or an edit
moves through its document in order, so the repeat of a common phrase ahead of where the
copying was is likelier the next text than one behind it or in the output. With none ahead,
or no match yet, the latest occurrence wins.

How many tokens: up to k where the match continues the last one's source (everything since
accepted, the target's own token included), where proposals are almost always accepted; one
where the match is fresh (the sequence's first, or after a rejection), where the first
proposal is accepted about half the time on a rewrite. A verifying row is not free (on a CPU
a 5-row step costs ~1.5x a 1-row one), so a fresh match is probed with one row first and
followed with k once it holds.

The index grows with the sequence, one entry per n-gram length per new token, so a proposal
costs a few dict lookups and a bisection however long the sequence is."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

FRESH_MATCH_TOKENS = 1  # proposals from a match that does not continue the last one's source


class NgramIndex:
    """For each n in [n_min, n_max]: n-gram -> the positions right after its occurrences that
    end before the sequence's last token, in order."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min = n_min
        self.n_max = n_max
        self.tables: dict[int, dict[tuple[int, ...], list[int]]] = {
            n: {} for n in range(n_min, n_max + 1)
        }
        self.indexed = 0  # n-grams ending before this position are in the tables
        self.source: int | None = None  # where the last match's proposal was copied from
        self.matched_at = 0  # the sequence's length then

    def _index_until(self, tokens: Sequence[int], end: int) -> None:
        for stop in range(max(self.indexed, self.n_min), end):
            for n, table in self.tables.items():
                if n <= stop:
                    table.setdefault(tuple(tokens[stop - n : stop]), []).append(stop)
        self.indexed = max(self.indexed, end)

    def _reached(self, length: int) -> int | None:
        """Where the last match's source continues for a sequence of this length."""
        return None if self.source is None else self.source + length - self.matched_at

    def _match(self, tokens: Sequence[int]) -> int | None:
        """The position after the chosen occurrence of the longest n-gram ending the tokens
        that occurred before; None without one."""
        length = len(tokens)
        reached = self._reached(length)
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            places = self.tables[n].get(tuple(tokens[length - n :]))
            if places:
                ahead = len(places) if reached is None else bisect_left(places, reached)
                return places[ahead] if ahead < len(places) else places[-1]
        return None

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the chosen match of `tokens`' end; [] when none
        matches. `tokens` only grows between calls (the same sequence)."""
        length = len(tokens)
        if k < 1 or length <= self.n_min:
            return []
        # n-grams ending at positions < length: a match always has a token after it
        self._index_until(tokens, length)
        start = self._match(tokens)
        if start is None:
            return []
        if start != self._reached(length):
            k = min(k, FRESH_MATCH_TOKENS)
        self.source, self.matched_at = start, length
        return list(tokens[start : min(start + k, length)])
