"""Tool calls read from model text as it grows, each character once: where the calls begin,
each call's JSON object, and inside it the call's name and arguments. A chunk of new text
costs work in proportion to its own length, however long the output already is.

Formats: hermes (`<tool_call>{...}</tool_call>`, one object per tagged part), llama3_json
(objects after `<|python_tag|>` or at the very start, separated by `;`) and mistral
(`[TOOL_CALLS][{...}, ...]`).
"""

from __future__ import annotations

import json
import re

_IN_STRING = re.compile(r'["\\]')
_STRUCTURE = re.compile(r'["{}\[\]:,]')
_NON_SPACE = re.compile(r"\S")
_HERMES_TAG = re.compile(r"</?tool_call>")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MARKERS = {"hermes": HERMES_OPEN, "llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}
ARGUMENT_KEYS = ("arguments", "parameters")


def held_suffix(text: str, *words: str) -> int:
    """How many trailing characters of text might begin one of the words."""
    longest = max(len(w) for w in words) - 1
    tail = text[-longest:] if longest and len(text) > longest else text
    for size in range(min(longest, len(tail)), 0, -1):
        if any(w.startswith(tail[-size:]) for w in words):
            return size
    return 0


class CallBody:
    """One call's JSON object, read from text[open_at] up to `pos`: brackets counted outside
    strings, and at the top level the value of "name" and the span of the arguments object."""

    def __init__(self, open_at: int):
        self.open_at = open_at
        self.pos = open_at
        self.end: int | None = None  # after the closing brace
        self.closed = False  # no more text belongs to it (complete, or cut by a hermes tag)
        self.name: str | None = None
        self.args_begin: int | None = None
        self.args_end: int | None = None
        self.args_first = False  # the arguments began before the name was read
        self._depth = 0
        self._in_string = self._escaped = False
        self._string_at = 0
        self._key_next = False  # at the top level, the next string is a key
        self._value_next = False  # at the top level, the next non-space begins a value
        self._key: str | None = None
        self._in_name = self._in_args = False

    @property
    def complete(self) -> bool:
        return self.end is not None

    def scan(self, text: str, upto: int) -> None:
        """Read text[pos:upto] (stops at the object's end)."""
        pos = self.pos
        while pos < upto and self.end is None:
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                    pos += 1
                    continue
                found = _IN_STRING.search(text, pos, upto)
                if found is None:
                    pos = upto
                    break
                pos = found.start()
                if text[pos] == "\\":
                    self._escaped = True
                else:
                    self._in_string = False
                    if self._depth == 1:
                        self._string_read(text[self._string_at : pos])
                pos += 1
                continue
            if self._value_next:
                found = _NON_SPACE.search(text, pos, upto)
                if found is None:
                    pos = upto
                    break
                pos = found.start()
                self._value_starts(text[pos], pos)
            found = _STRUCTURE.search(text, pos, upto)
            if found is None:
                pos = upto
                break
            pos = found.start()
            self._structure(text[pos], pos)
            pos += 1
        self.pos = pos
        if self.end is not None:
            self.closed = True

    def _structure(self, char: str, pos: int) -> None:
        if char == '"':
            self._in_string, self._string_at = True, pos + 1
        elif char in "{[":
            self._depth += 1
            self._key_next = self._depth == 1
        elif char in "}]":
            self._depth -= 1
            if self._in_args and self._depth == 1:
                self.args_end, self._in_args = pos + 1, False
            if self._depth == 0:
                self.end = pos + 1
        elif self._depth == 1:
            if char == ":":
                self._value_next = True
            elif char == ",":
                self._key_next = True

    def _string_read(self, raw: str) -> None:
        if self._key_next:
            self._key, self._key_next = raw, False
        elif self._in_name:
            self._in_name = False
            try:
                name = json.loads(f'"{raw}"')
            except ValueError:
                return
            self.name = name if isinstance(name, str) else None

    def _value_starts(self, char: str, pos: int) -> None:
        self._value_next = False
        key, self._key = self._key, None
        if key == "name" and char == '"' and self.name is None:
            self._in_name = True
        elif key in ARGUMENT_KEYS and char == "{" and self.args_begin is None:
            self.args_begin, self._in_args = pos, True
            self.args_first = self.name is None


class CallScanner:
    """The calls of one output in one format, read incrementally: `find_start` until the
    calls begin, then `read` with the text as it grows (never shrinks)."""

    def __init__(self, parser: str, max_calls: int | None = None):
        self.parser = parser
        self.marker = MARKERS[parser]
        self.max_calls = max_calls
        self.start: int | None = None
        self.bodies: list[CallBody] = []
        self._searched = 0  # the marker does not begin before this
        self._lead: int | None = None  # llama3_json: the first non-space character
        self._lead_from = 0
        self._cursor = 0  # what the segmenting has examined
        self._part: bool = False  # hermes: inside a tagged part
        self._part_body: CallBody | None = None

    def find_start(self, text: str) -> int | None:
        if self.start is not None:
            return self.start
        at = text.find(self.marker, self._searched)
        if at == -1:
            self._searched = max(self._searched, len(text) - len(self.marker) + 1)
            if self.parser == "llama3_json" and self._lead is None:
                found = _NON_SPACE.search(text, self._lead_from)
                self._lead = None if found is None else found.start()
                self._lead_from = len(text)
                if self._lead is not None and text[self._lead] == "{":
                    at = self._lead
        if at != -1:
            self.start = self._cursor = at
        return self.start

    @property
    def searched(self) -> int:
        """Before the calls begin: they cannot begin before this character."""
        if self.parser == "llama3_json" and self._lead is None:
            return 0
        return max(0, self._searched)

    def rebase(self, drop: int) -> None:
        """Before the calls begin: the text will come without its first `drop` characters
        (at most `searched`)."""
        if self.start is not None or drop > self.searched:
            raise ValueError(f"cannot drop {drop} characters of text still to be read")
        self._searched -= drop
        self._lead_from = max(0, self._lead_from - drop)
        self._cursor = max(0, self._cursor - drop)

    def held(self, text: str) -> int:
        """Before the calls begin: trailing characters that may still open them."""
        if self.parser == "llama3_json" and self._lead is None:
            return len(text)  # the output may still open with a call
        return held_suffix(text, self.marker)

    def read(self, text: str, finished: bool) -> set[int]:
        """Read what arrived since the last call; the indices of the bodies that grew."""
        if self.start is None:
            return set()
        if self.parser == "hermes":
            return self._read_parts(text, finished)
        return self._read_objects(text)

    def _room(self) -> bool:
        return self.max_calls is None or len(self.bodies) < self.max_calls

    def _scan(self, body: CallBody, text: str, upto: int, grew: set[int]) -> None:
        """Read more of the newest body."""
        before = body.pos
        body.scan(text, upto)
        if body.pos != before:
            grew.add(len(self.bodies) - 1)

    def _read_objects(self, text: str) -> set[int]:
        """Top-level objects one after another; what lies between them is skipped."""
        grew: set[int] = set()
        while True:
            body = self.bodies[-1] if self.bodies else None
            if body is not None and not body.complete:
                self._scan(body, text, len(text), grew)
                if not body.complete:
                    return grew
                self._cursor = body.pos
            if not self._room():
                return grew
            at = text.find("{", self._cursor)
            if at == -1:
                self._cursor = len(text)
                return grew
            self.bodies.append(CallBody(at))

    def _read_parts(self, text: str, finished: bool) -> set[int]:
        """hermes: each `<tool_call>` opens a part that the next tag ends; the part's first
        object is its call. A tag that may still be arriving is not read yet."""
        grew: set[int] = set()
        while True:
            if not self._part:
                at = text.find(HERMES_OPEN, self._cursor)
                if at == -1:
                    self._cursor = max(self._cursor, len(text) - len(HERMES_OPEN) + 1)
                    return grew
                self._part, self._part_body = True, None
                self._cursor = at + len(HERMES_OPEN)
            tag = _HERMES_TAG.search(text, self._cursor)
            if tag is not None:
                limit = tag.start()
            else:
                limit = len(text) - (0 if finished else held_suffix(text, HERMES_CLOSE))
            body = self._part_body
            if body is None and self._room():
                at = text.find("{", self._cursor, limit)
                if at != -1:
                    body = self._part_body = CallBody(at)
                    self.bodies.append(body)
            if body is not None and not body.complete:
                self._scan(body, text, limit, grew)
            if tag is None:
                self._cursor = max(self._cursor, limit)
                return grew
            if body is not None:
                body.closed = True
            self._part = False
            self._cursor = tag.start() if tag.group() == HERMES_OPEN else tag.end()
