"""Token ids -> text, one token at a time, with stop strings; the text comes out in pieces.

Byte-level BPE tokens can split a UTF-8 character. Decoders replace an incomplete UTF-8 tail
with one U+FFFD (the maximal-subpart rule), so only a final U+FFFD is held back: it is at most
3 bytes that the next token may complete. Everything before it, invalid bytes included (as
U+FFFD), is text at once; the held character comes out with the next token either way.

Work per token is bounded whatever the length: the decodes read a window of a few tokens, the
stop strings are searched in the new characters (and the few before them that a stop string
may start in), and the text lives as pieces already handed out plus a short open tail. `take`
hands out what is new and stable; `text` joins the whole (for tests and callers that want it
once).
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self,
        decoder: Decoder,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ):
        self.decoder = decoder
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.skip_special = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        # Characters at the end of the text decoded from tokens after read_offset (a window
        # still open because it ended in a possibly incomplete character).
        self.pending_chars = 0
        # The text is `_done` (pieces, never changed again) followed by `_tail`, which begins
        # at character `_tail_at`; `_taken` characters have been handed out by take().
        self._done: list[str] = []
        self._tail = ""
        self._tail_at = 0
        self._taken = 0

    def reset(self) -> None:
        self.token_ids.clear()
        self.prefix_offset = self.read_offset = 0
        self.pending_chars = 0
        self._done.clear()
        self._tail = ""
        self._tail_at = self._taken = 0

    @property
    def length(self) -> int:
        """Characters of text so far."""
        return self._tail_at + len(self._tail)

    @property
    def open_chars(self) -> int:
        """Characters of the open tail: what adding a token may read or copy."""
        return len(self._tail)

    @property
    def text(self) -> str:
        """The whole text so far (joined: work in proportion to its length)."""
        return "".join(self._done) + self._tail

    def _decode(self, ids: list[int]) -> str:
        return self.decoder.decode(ids, skip_special_tokens=self.skip_special)

    def _replace_from(self, at: int, piece: str) -> None:
        """text = text[:at] + piece (at lies in the tail)."""
        self._tail = self._tail[: max(at, self._tail_at) - self._tail_at] + piece

    def add(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append a token; returns the stop string it completed (text is cut there), if any."""
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) <= len(prefix):
            return None
        start = self.length
        new = full[len(prefix) :]
        keep = self.length - self.pending_chars
        if new.endswith(REPLACEMENT):
            # Possibly an incomplete tail: show what precedes it, keep the window open.
            self._replace_from(keep, new[:-1])
            self.pending_chars = len(new) - 1
        else:
            self._replace_from(keep, new)
            self.pending_chars = 0
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
        start = min(start, self.length)
        return self._find_stop(start) if check_stop else None

    def flush(self) -> None:
        """At the end, keep whatever is pending even if it ends mid-character."""
        rest = self._decode(self.token_ids[self.prefix_offset :])
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        if len(rest) > len(prefix):
            self._replace_from(self.length - self.pending_chars, rest[len(prefix) :])
        self.pending_chars = 0
        self.prefix_offset = self.read_offset = len(self.token_ids)

    def _find_stop(self, new_from: int) -> str | None:
        best: tuple[int, str] | None = None
        base = self._tail_at
        for stop in self.stop:
            at = self._tail.find(stop, max(0, new_from - len(stop) + 1 - base))
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self._tail = self._tail[: at + len(stop) if self.include_stop else at]
        return stop

    def stable_length(self, finished: bool) -> int:
        """How much of the text can be shown now without risking a stop string leaking."""
        return self.length if finished else max(0, self.length - self.hold_back)

    def take(self, finished: bool) -> str:
        """The stable text not handed out before (all of it once finished)."""
        stable = self.stable_length(finished)
        if stable <= self._taken:
            return ""
        base = self._tail_at
        piece = self._tail[self._taken - base : stable - base]
        self._taken = stable
        # What was handed out and can no longer change (an open window may be decoded again,
        # a stop string may start in the held-back characters) leaves the tail.
        fixed = min(self._taken, self.length - self.pending_chars) - base
        if fixed > 0:
            self._done.append(self._tail[:fixed])
            self._tail = self._tail[fixed:]
            self._tail_at += fixed
        return piece
