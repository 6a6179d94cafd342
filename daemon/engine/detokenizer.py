"""Token ids -> text, one token at a time, with stop strings.

Byte-level BPE tokens can split a UTF-8 character. Decoders replace an incomplete UTF-8 tail
with one U+FFFD (the maximal-subpart rule), so only a final U+FFFD is held back: it is at most
3 bytes that the next token may complete. Everything before it, invalid bytes included (as
U+FFFD), is text at once; the held character comes out with the next token either way.
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
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        # Characters of `text` decoded from tokens after read_offset (a window still open
        # because it ended in a possibly incomplete character).
        self.pending_chars = 0

    def reset(self) -> None:
        self.token_ids.clear()
        self.text = ""
        self.prefix_offset = self.read_offset = 0
        self.pending_chars = 0

    def _decode(self, ids: list[int]) -> str:
        return self.decoder.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append a token; returns the stop string it completed (text is cut there), if any."""
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) <= len(prefix):
            return None
        start = len(self.text)
        new = full[len(prefix) :]
        if new.endswith(REPLACEMENT):
            # Possibly an incomplete tail: show what precedes it, keep the window open.
            self.text = self.text[: len(self.text) - self.pending_chars] + new[:-1]
            self.pending_chars = len(new) - 1
        else:
            self.text = self.text[: len(self.text) - self.pending_chars] + new
            self.pending_chars = 0
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
        start = min(start, len(self.text))
        return self._find_stop(start) if check_stop else None

    def flush(self) -> None:
        """At the end, keep whatever is pending even if it ends mid-character."""
        rest = self._decode(self.token_ids[self.prefix_offset :])
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        if len(rest) > len(prefix):
            self.text = self.text[: len(self.text) - self.pending_chars] + rest[len(prefix) :]
        self.pending_chars = 0
        self.prefix_offset = self.read_offset = len(self.token_ids)

    def _find_stop(self, new_from: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self.stop:
            at = self.text.find(stop, max(0, new_from - len(stop) + 1))
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[: at + len(stop) if self.include_stop else at]
        return stop

    def stable_length(self, finished: bool) -> int:
        """How much of `text` can be shown now without risking a stop string leaking."""
        return len(self.text) if finished else max(0, len(self.text) - self.hold_back)
