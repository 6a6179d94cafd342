"""gpt-oss's harmony output read as it grows: messages `<|start|>assistant<|channel|>NAME
[to=RECIPIENT] [<|constrain|>json]<|message|>BODY<|end|>` (the first message's `<|start|>
assistant` is the prompt's). The analysis channel is reasoning, final (and commentary with no
recipient: a preamble) the answer, and a message to `functions.NAME` a tool call whose body
is its arguments; `<|call|>` and `<|return|>` end the output.

The markers are special tokens: the output must be detokenized with them kept. An output
that is not harmony, and whatever follows a header or separator the format does not allow,
is answer text as written; a header that max_tokens cut is left out.
"""

from __future__ import annotations

import re

from cpud.frontend.reasoning_split import Split
from cpud.frontend.tool_call_scan import held_suffix
from cpud.frontend.tool_calls import new_call_id

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
BODY_ENDS = (END, CALL, RETURN, START)
IN_BODY = (*BODY_ENDS, MESSAGE)  # markers a body's end is read for
MARKER = re.compile(r"<\|(?:start|end|call|return|message)\|>")
CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
RECIPIENT = re.compile(r"\bto=([^\s<]+)")
MAX_HEADER = 512  # characters: a longer header is not harmony
FUNCTIONS = "functions."


class HarmonyParser:
    def __init__(self, header: str | None = None, max_calls: int | None = None):
        """header: the prompt opened a message with this header (the output starts in its
        body). max_calls: calls past this many are left out (parallel_tool_calls false)."""
        self.max_calls = max_calls
        self.state = "header"  # header | body | between | plain
        self.pending = ""
        self.kind = "content"  # the open body's destination: reasoning | content | call | skip
        self.calls = 0
        self._opened = Split()  # news of the header the prompt opened, sent with the first feed
        if header is not None:
            self.state = "body"
            self.kind = self._open(header, self._opened)

    @property
    def called(self) -> bool:
        return self.calls > 0

    @property
    def in_reasoning(self) -> bool:
        """Inside an analysis message's body."""
        return self.state == "body" and self.kind == "reasoning"

    def feed(self, delta: str) -> Split:
        self.pending += delta
        out, self._opened = self._opened, Split()
        while self.pending:
            if self.state == "plain":
                out.content += self.pending
                self.pending = ""
            elif self.state == "header":
                if not self._header(out):
                    break
            elif self.state == "between":
                if self.pending.startswith(START):
                    self.state = "header"
                elif not START.startswith(self.pending):
                    self.state = "plain"
                else:
                    break
            elif not self._body(out):
                break
        return out

    def finish(self, cut: bool) -> Split:
        out, self._opened = self._opened, Split()
        rest, self.pending = self.pending, ""
        if self.state == "body":
            if cut:
                rest = rest[: len(rest) - held_suffix(rest, *IN_BODY)]
            self._emit(rest, out)
        elif self.state == "plain" or not cut:
            out.content += rest  # a header or separator the output stopped in: as written
        return out

    def _header(self, out: Split) -> bool:
        """Read the header; False while it is incomplete."""
        at = self.pending.find(MESSAGE)
        header = self.pending if at == -1 else self.pending[:at]
        if not _header_may_be(header):
            self.state = "plain"
            return True
        if at == -1:
            return False
        self.pending = self.pending[at + len(MESSAGE) :]
        self.kind = self._open(header, out)
        self.state = "body"
        return True

    def _open(self, header: str, out: Split) -> str:
        """The destination of a message's body, by its header; a call's first delta."""
        recipient = RECIPIENT.search(header)
        if recipient is not None:
            if self.max_calls is not None and self.calls >= self.max_calls:
                return "skip"
            name = recipient.group(1).removeprefix(FUNCTIONS)
            function = {"name": name, "arguments": ""}
            call = {"index": self.calls, "id": new_call_id(), "type": "function"}
            out.calls.append({**call, "function": function})
            self.calls += 1
            return "call"
        channel = CHANNEL_NAME.search(header)
        return "reasoning" if channel is not None and channel.group(1) == "analysis" else "content"

    def _body(self, out: Split) -> bool:
        """Emit the body up to its end marker; False while the rest may be one arriving."""
        found = MARKER.search(self.pending)
        if found is None or found.group() not in BODY_ENDS:
            cut = found.start() if found is not None else None
            if cut is None:
                cut = len(self.pending) - held_suffix(self.pending, *IN_BODY)
                self._emit(self.pending[:cut], out)
                self.pending = self.pending[cut:]
                return False
            # A <|message|> inside a body: not harmony from here on.
            self._emit(self.pending[:cut], out)
            self.pending, self.state = self.pending[cut:], "plain"
            return True
        self._emit(self.pending[: found.start()], out)
        if found.group() == START:
            self.pending, self.state = self.pending[found.start() :], "between"
        else:
            self.pending, self.state = self.pending[found.end() :], "between"
        return True

    def _emit(self, text: str, out: Split) -> None:
        if not text or self.kind == "skip":
            return
        if self.kind == "reasoning":
            out.reasoning += text
        elif self.kind == "content":
            out.content += text
        else:
            out.calls.append({"index": self.calls - 1, "function": {"arguments": text}})


HEADER_OPENINGS = (START, CHANNEL, "to=")  # the last: a recipient after the prompt's role


def _header_may_be(header: str) -> bool:
    """Whether header text (complete or still arriving) can begin a harmony header."""
    if len(header) > MAX_HEADER or any(m in header for m in (END, CALL, RETURN)):
        return False
    lead = header.lstrip(" ")[: max(len(START), len(CHANNEL))]
    return any(lead.startswith(m) or m.startswith(lead) for m in HEADER_OPENINGS)
