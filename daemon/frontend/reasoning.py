"""Reasoning in model output, split from the answer as vLLM's reasoning parsers name them:
qwen3 and deepseek_r1 (`<think>...</think>` before the answer) and openai_gptoss (harmony
channels, see harmony.py).

A parser reads only the text that is new at each step (`feed`), and `finish` hands back what
it held at the end; each call returns a Split: reasoning text, answer text and, for formats
that carry their own tool calls (harmony), OpenAI tool-call deltas. Text the format does not
explain is answer text: a malformed or truncated marker never fails a request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from cpud.frontend.tool_call_scan import held_suffix
from cpud.settings import choices

PARSERS = choices("reasoning_parser")
HARMONY = "openai_gptoss"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
OFF = "none"


@dataclass
class Split:
    """What one step of output adds: reasoning, answer text, tool-call deltas."""

    reasoning: str = ""
    content: str = ""
    calls: list[dict] = field(default_factory=list)

    def extend(self, other: Split) -> Split:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls
        return self


class ReasoningParser(Protocol):
    @property
    def called(self) -> bool: ...  # a tool call has begun

    def feed(self, delta: str) -> Split: ...

    def finish(self, cut: bool) -> Split: ...  # cut: max_tokens ended the output


@dataclass(frozen=True)
class ReasoningPlan:
    """How one request's output is read. opened: the prompt ends inside a think block (the
    model starts in its reasoning); header: harmony, the header of a message the prompt
    opened (the model starts in that message's body)."""

    parser: str
    opened: bool = False
    header: str | None = None
    max_calls: int | None = None  # harmony: parallel_tool_calls false reads one call
    shown: bool = True  # include_reasoning false: the reasoning is split off and dropped

    @property
    def reads_calls(self) -> bool:
        """The format carries its own tool calls (no tool-call parser reads the answer)."""
        return self.parser == HARMONY


def detect_reasoning_parser(template: str | None) -> str | None:
    """The reasoning format a chat template shows: harmony markers, or think blocks."""
    text = template or ""
    if "<|channel|>" in text and "<|message|>" in text:
        return HARMONY
    if THINK_OPEN in text and THINK_CLOSE in text:
        return "qwen3"
    return None


def thinking_disabled(template_kwargs: dict | None) -> bool:
    """chat_template_kwargs turning reasoning off (Qwen3's enable_thinking, Granite's and
    DeepSeek's thinking)."""
    kwargs = template_kwargs or {}
    return kwargs.get("enable_thinking") is False or kwargs.get("thinking") is False


def plan_reasoning(
    parser: str | None,
    prompt: str,
    template_kwargs: dict | None = None,
    constrained: bool = False,
    max_calls: int | None = None,
) -> ReasoningPlan | None:
    """How to read the output of `prompt` (the rendered conversation) with the configured or
    detected parser; None: all of it is the answer. A constrained output (response_format, a
    forced tool call) is shaped by its grammar from the first token: it has no reasoning."""
    if parser is None or parser == OFF or constrained:
        return None
    if parser == HARMONY:
        return ReasoningPlan(parser, header=_open_harmony_header(prompt), max_calls=max_calls)
    if thinking_disabled(template_kwargs):
        return None
    tail = prompt.rstrip()
    if tail.endswith(THINK_CLOSE):
        return None  # the template closed the reasoning (thinking off)
    return ReasoningPlan(parser, opened=parser == "deepseek_r1" or tail.endswith(THINK_OPEN))


def _open_harmony_header(prompt: str) -> str | None:
    from cpud.frontend.harmony import MESSAGE, START

    if not prompt.endswith(MESSAGE):
        return None
    start = prompt.rfind(START)
    return prompt[start + len(START) : -len(MESSAGE)] if start != -1 else None


def new_parser(plan: ReasoningPlan) -> ReasoningParser:
    if plan.parser == HARMONY:
        from cpud.frontend.harmony import HarmonyParser

        return HarmonyParser(plan.header, plan.max_calls)
    return ThinkParser(plan.opened)


class ThinkParser:
    """`<think>reasoning</think>answer`. The block opens the output, or the prompt opened
    it (`opened`: an opening tag the model writes anyway is left out); an output that
    begins otherwise is all answer. Whitespace around the reasoning and before the answer is
    left out. A block that never closes (max_tokens cut it) is all reasoning."""

    called = False

    def __init__(self, opened: bool):
        self.opened = opened
        self.state = "start"
        self.pending = ""  # held back: a marker that may be arriving, trailing whitespace
        self.reasoning_began = False
        self.content_began = False

    def feed(self, delta: str) -> Split:
        self.pending += delta
        out = Split()
        while True:
            if self.state == "start":
                lead = self.pending.lstrip()
                if lead.startswith(THINK_OPEN):
                    self.pending, self.state = lead[len(THINK_OPEN) :], "reasoning"
                elif not lead or THINK_OPEN.startswith(lead):
                    return out
                else:
                    self.state = "reasoning" if self.opened else "content"
            elif self.state == "reasoning":
                at = self.pending.find(THINK_CLOSE)
                if at == -1:
                    keep = held_suffix(self.pending, THINK_CLOSE)
                    shown = self.pending[: len(self.pending) - keep].rstrip()
                    out.reasoning += self._reasoning(shown)
                    self.pending = self.pending[len(shown) :]
                    return out
                out.reasoning += self._reasoning(self.pending[:at].rstrip())
                self.pending, self.state = self.pending[at + len(THINK_CLOSE) :], "content"
            else:
                out.content += self._content(self.pending)
                self.pending = ""
                return out

    def finish(self, cut: bool) -> Split:
        rest, self.pending = self.pending, ""
        if self.state == "start":
            lead = rest.lstrip()
            if cut and lead and THINK_OPEN.startswith(lead):
                rest = ""  # an opening tag max_tokens cut
            self.state = "reasoning" if self.opened else "content"
        if self.state == "reasoning":
            if cut and held_suffix(rest, THINK_CLOSE):
                rest = rest[: len(rest) - held_suffix(rest, THINK_CLOSE)]
            return Split(reasoning=self._reasoning(rest.rstrip()))
        return Split(content=self._content(rest))

    def _reasoning(self, text: str) -> str:
        if not self.reasoning_began:
            text = text.lstrip()
            self.reasoning_began = bool(text)
        return text

    def _content(self, text: str) -> str:
        if not self.content_began:
            text = text.lstrip()
            self.content_began = bool(text)
        return text
