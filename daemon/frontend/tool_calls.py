"""Tool calls in model text, in the formats vLLM's parsers name: hermes (Hermes, Qwen:
`<tool_call>{"name", "arguments"}</tool_call>`), llama3_json (`{"name", "parameters"}`, calls
separated by `;`) and mistral (`[TOOL_CALLS][{"name", "arguments"}, ...]`).

One scanner serves both answers: `parse` on the whole text, and `ToolCallStream` on the text
as it grows, which yields OpenAI's deltas (the call's index, id, type and name first, then
fragments of its arguments, whose concatenation is the arguments' JSON text).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

PARSERS = ("hermes", "llama3_json", "mistral")
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


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


def _object_end(text: str, start: int) -> int | None:
    """Index after the JSON object or array opening at text[start], or None if it is open."""
    depth = 0
    in_string = escaped = False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


@dataclass(frozen=True)
class _Body:
    """One call's JSON object text; complete when its closing brace has arrived."""

    text: str
    complete: bool


class _Format:
    marker = ""

    def calls_start(self, text: str, finished: bool) -> int | None:
        """Where the calls begin, or None if there are none (yet)."""
        at = text.find(self.marker)
        return None if at == -1 else at

    def held(self, text: str) -> int:
        """How many trailing characters might begin the marker (not content yet)."""
        for size in range(min(len(self.marker) - 1, len(text)), 0, -1):
            if self.marker.startswith(text[-size:]):
                return size
        return 0

    def bodies(self, region: str) -> list[_Body]:
        return _objects(region)


def _objects(region: str) -> list[_Body]:
    """The top-level JSON objects of a region, skipping separators between them."""
    bodies = []
    at = region.find("{")
    while at != -1:
        end = _object_end(region, at)
        if end is None:
            bodies.append(_Body(region[at:], False))
            break
        bodies.append(_Body(region[at:end], True))
        at = region.find("{", end)
    return bodies


class _Hermes(_Format):
    marker = "<tool_call>"

    def bodies(self, region: str) -> list[_Body]:
        found = []
        for part in region.split(self.marker)[1:]:
            objects = _objects(part.split("</tool_call>")[0])
            if objects:
                found.append(objects[0])
        return found


class _Mistral(_Format):
    marker = "[TOOL_CALLS]"


class _Llama3(_Format):
    marker = "<|python_tag|>"

    def calls_start(self, text: str, finished: bool) -> int | None:
        at = text.find(self.marker)
        if at != -1:
            return at
        stripped = len(text) - len(text.lstrip())
        return stripped if text[stripped:].startswith("{") else None

    def held(self, text: str) -> int:
        if not text.strip():
            return len(text)  # the output may still open with a call
        return super().held(text)


FORMATS: dict[str, _Format] = {"hermes": _Hermes(), "llama3_json": _Llama3(), "mistral": _Mistral()}


def _arguments(body: _Body) -> tuple[int, int | None] | None:
    """(start, end or None while open) of the arguments object inside a call body."""
    match = _ARGS.search(body.text)
    if match is None or not body.text[match.end() :].startswith("{"):
        return None
    return match.end(), _object_end(body.text, match.end())


def _complete_call(body: _Body) -> ParsedCall | None:
    try:
        value = json.loads(body.text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        return ParsedCall(value["name"], args)
    return ParsedCall(value["name"], json.dumps(args, ensure_ascii=False))


def parse(text: str, parser: str, parallel: bool = True) -> Parsed:
    """The calls in a finished output (the first only unless parallel), and the text before
    them as content (None if empty). An output whose calls do not parse is all content."""
    fmt = FORMATS[parser]
    start = fmt.calls_start(text, True)
    if start is None:
        return Parsed(text or None, [])
    calls = [_complete_call(b) for b in fmt.bodies(text[start:]) if b.complete]
    valid = [c for c in calls if c is not None]
    if not valid:
        return Parsed(text or None, [])
    return Parsed(text[:start].strip() or None, valid if parallel else valid[:1])


@dataclass
class _Sent:
    id: str
    name_sent: bool = False
    args_chars: int = 0
    done: bool = False


@dataclass
class ToolCallStream:
    """Deltas for one choice as its text grows: content first, then tool-call deltas."""

    parser: str
    max_calls: int | None = None  # parallel_tool_calls false: 1
    content_chars: int = 0
    calls: list[_Sent] = field(default_factory=list)

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        """(new content, tool-call deltas) for the text so far."""
        fmt = FORMATS[self.parser]
        start = fmt.calls_start(text, finished)
        if start is None:
            end = len(text) if finished else len(text) - fmt.held(text)
            content = text[self.content_chars : max(end, self.content_chars)]
            self.content_chars = max(end, self.content_chars)
            return content, []
        content = text[self.content_chars : start] if start > self.content_chars else ""
        self.content_chars = max(start, self.content_chars)
        deltas = []
        for index, body in enumerate(fmt.bodies(text[start:])[: self.max_calls]):
            if index == len(self.calls):
                self.calls.append(_Sent(new_call_id()))
            delta = self._advance(index, self.calls[index], body, finished)
            if delta is not None:
                deltas.append(delta)
        return content, deltas

    def _advance(self, index: int, sent: _Sent, body: _Body, finished: bool) -> dict | None:
        if sent.done:
            return None
        function: dict = {}
        if not sent.name_sent:
            name = _NAME.search(body.text)
            if name is None or (not body.complete and _ARGS.search(body.text[: name.start()])):
                return None  # the name is not known yet (or comes after the arguments)
            function["name"] = json.loads(f'"{name.group(1)}"')
            function["arguments"] = ""
            sent.name_sent = True
        span = _arguments(body)
        if span is not None:
            begin, end = span
            upto = len(body.text) if end is None else end
            fragment = body.text[begin + sent.args_chars : upto]
            sent.args_chars = upto - begin
            sent.done = end is not None
        elif body.complete or finished:
            call = _complete_call(body) if body.complete else None
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
