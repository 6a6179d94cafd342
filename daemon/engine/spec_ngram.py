"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of the
sequence's last n tokens (prompt and output so far), the longest n in [n_min, n_max] first.

The index grows with the sequence, one entry per n-gram length per new token, so a proposal
costs a few dict lookups however long the sequence is."""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """For each n in [n_min, n_max]: n-gram -> the position right after its latest occurrence
    that ends before the sequence's last token."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min = n_min
        self.n_max = n_max
        self.tables: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(n_min, n_max + 1)
        }
        self.indexed = 0  # n-grams ending before this position are in the tables

    def _index_until(self, tokens: Sequence[int], end: int) -> None:
        for stop in range(max(self.indexed, self.n_min), end):
            for n, table in self.tables.items():
                if n <= stop:
                    table[tuple(tokens[stop - n : stop])] = stop
        self.indexed = max(self.indexed, end)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest matching n-gram of `tokens`' end; [] when
        none matches. `tokens` only grows between calls (the same sequence)."""
        length = len(tokens)
        if k < 1 or length <= self.n_min:
            return []
        # n-grams ending at positions < length: a match always has a token after it
        self._index_until(tokens, length)
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            after = self.tables[n].get(tuple(tokens[length - n :]))
            if after is not None:
                return list(tokens[after : min(after + k, length)])
        return []
