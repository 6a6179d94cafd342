"""Tool calls in model text, in the formats vLLM's parsers name: hermes (Hermes, Qwen:
`<tool_call>{"name", "arguments"}</tool_call>`), llama3_json (`{"name", "parameters"}`, calls
separated by `;`) and mistral (`[TOOL_CALLS][{"name", "arguments"}, ...]`).

One scanner (tool_call_scan) serves both answers: `parse` on the whole text, and
`ToolCallStream` on the text as it grows (`feed_delta` with each new piece), which yields
OpenAI's deltas (the call's index, id, type and name first, then fragments of its arguments,
whose concatenation is the arguments' JSON text). Each chunk reads only the text that is new,
and before the calls begin keeps only the few characters that may still open one.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from cpud.frontend.tool_call_scan import CallBody, CallScanner
from cpud.settings import choices

PARSERS = choices("tool_call_parser")


def detect_parser(template: str | None) -> str:
    """The parser a chat template's own tool format needs; hermes when it shows none."""
    text = template or ""
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<tool_call>" in text:
        return "hermes"
    if "<|python_tag|>" in text or ("ipython" in text and '"parameters"' in text):
        return "llama3_json"
    return "hermes"


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class Parsed:
    content: str | None
    calls: list[ParsedCall]


def _complete_call(body: str) -> ParsedCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        return ParsedCall(value["name"], args)
    return ParsedCall(value["name"], json.dumps(args, ensure_ascii=False))


def _cut_call(body: CallBody, text: str) -> ParsedCall | None:
    """A call that max_tokens cut, as its stream sends it: the arguments as far as they
    came (not yet JSON), once its name is known."""
    if body.name is None or body.args_first:
        return None
    if body.args_begin is None:
        return ParsedCall(body.name, "")
    end = body.pos if body.args_end is None else body.args_end
    return ParsedCall(body.name, text[body.args_begin : end])


def parse(text: str, parser: str, parallel: bool = True, cut: bool = False) -> Parsed:
    """The calls in a finished output (the first only unless parallel), and the text before
    them as content (None if empty). An output whose calls do not parse is all content,
    unless max_tokens cut it (`cut`) inside its first call: then that call comes as far as
    it came and the call markup never shows in the content. A call cut after whole ones is
    left out (a client would run its broken arguments)."""
    scanner = CallScanner(parser)
    start = scanner.find_start(text)
    if start is None:
        return Parsed(text or None, [])
    scanner.read(text, True)
    calls = [_complete_call(text[b.open_at : b.end]) for b in scanner.bodies if b.complete]
    valid = [c for c in calls if c is not None]
    if cut and not valid and scanner.bodies and not scanner.bodies[-1].complete:
        partial = _cut_call(scanner.bodies[-1], text)
        valid = [partial] if partial is not None else []
    # A cut call shows no markup, unless what began was a bare object (llama3_json), which
    # may be an answer as well as a call.
    if not valid and not (cut and text.startswith(scanner.marker, start)):
        return Parsed(text or None, [])
    return Parsed(text[:start].strip() or None, valid if parallel else valid[:1])


@dataclass
class _Sent:
    id: str
    name_sent: bool = False
    args_chars: int = 0
    done: bool = False


class ToolCallStream:
    """Deltas for one choice as its text grows: content first, then tool-call deltas."""

    def __init__(self, parser: str, max_calls: int | None = None):
        self.parser = parser
        self.max_calls = max_calls  # parallel_tool_calls false: 1
        self.content_chars = 0  # of _text
        self.calls: list[_Sent] = []
        self._scanner = CallScanner(parser, max_calls)
        # The output's text from character _base on: before the calls begin, content that
        # went out and can no longer begin a call is dropped, so a long answer costs each
        # step only its new text.
        self._text = ""
        self._base = 0

    @property
    def called(self) -> bool:
        return any(sent.name_sent for sent in self.calls)

    @property
    def kept_chars(self) -> int:
        """Characters of the output kept to read the next piece against."""
        return len(self._text)

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        """(new content, tool-call deltas) for the text so far (the previous text and more)."""
        return self.feed_delta(text[self._base + len(self._text) :], finished)

    def feed_delta(self, new: str, finished: bool) -> tuple[str, list[dict]]:
        """(new content, tool-call deltas) for the output's next piece of text."""
        self._text += new
        result = self._read(self._text, finished)
        scanner = self._scanner
        if scanner.start is None:
            drop = min(self.content_chars, scanner.searched)
            if drop > 0:
                self._text = self._text[drop:]
                self._base += drop
                self.content_chars -= drop
                scanner.rebase(drop)
        return result

    def _read(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        scanner = self._scanner
        start = scanner.find_start(text)
        if start is None:
            end = len(text) if finished else len(text) - scanner.held(text)
            content = text[self.content_chars : max(end, self.content_chars)]
            self.content_chars = max(end, self.content_chars)
            return content, []
        content = text[self.content_chars : start] if start > self.content_chars else ""
        self.content_chars = max(start, self.content_chars)
        grew = scanner.read(text, finished)
        while len(self.calls) < len(scanner.bodies):
            self.calls.append(_Sent(new_call_id()))
        # Only a body that grew can have news, until the end, when every open call closes.
        indices = range(len(scanner.bodies)) if finished else sorted(grew)
        deltas = []
        for index in indices:
            delta = self._advance(index, scanner.bodies[index], text, finished)
            if delta is not None:
                deltas.append(delta)
        if finished and not self.called and not text.startswith(scanner.marker, start):
            # A bare object (llama3_json) that named no function was an answer after all.
            content += text[self.content_chars :]
            self.content_chars = len(text)
        return content, deltas

    def _advance(self, index: int, body: CallBody, text: str, finished: bool) -> dict | None:
        sent = self.calls[index]
        if sent.done:
            return None
        function: dict = {}
        if not sent.name_sent:
            if body.name is None or (not body.complete and body.args_first):
                return None  # the name is not known yet (or comes after the arguments)
            function["name"] = body.name
            function["arguments"] = ""
            sent.name_sent = True
        if body.args_begin is not None:
            upto = body.pos if body.args_end is None else body.args_end
            fragment = text[body.args_begin + sent.args_chars : upto]
            sent.args_chars = upto - body.args_begin
            sent.done = body.args_end is not None
        elif body.complete or finished:
            call = _complete_call(text[body.open_at : body.end]) if body.complete else None
            fragment = call.arguments if call is not None else ""
            sent.done = True
        else:
            fragment = ""
        if fragment:
            function["arguments"] = function.get("arguments", "") + fragment
        if not function:
            return None
        delta: dict = {"index": index, "function": function}
        if "name" in function:
            delta = {"index": index, "id": sent.id, "type": "function", "function": function}
        return delta
