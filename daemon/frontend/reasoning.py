"""Reasoning in model output, split from the answer as vLLM's reasoning parsers name them:
qwen3 and deepseek_r1 (`<think>...</think>` before the answer) and openai_gptoss (harmony
channels, see harmony.py).

A parser reads only the text that is new at each step (`feed`), and `finish` hands back what
it held at the end; each call returns a Split: reasoning text, answer text and, for formats
that carry their own tool calls (harmony), OpenAI tool-call deltas. Text the format does not
explain is answer text: a malformed or truncated marker never fails a request.
"""

from __future__ import annotations

from dataclasses import dataclass

from cpud.frontend.harmony import MESSAGE, START, HarmonyParser
from cpud.frontend.reasoning_split import ReasoningParser
from cpud.frontend.reasoning_think import THINK_CLOSE, THINK_OPEN, ThinkParser
from cpud.settings import choices

PARSERS = choices("reasoning_parser")
HARMONY = "openai_gptoss"
OFF = "none"


@dataclass(frozen=True)
class ReasoningPlan:
    """How one request's output is read. opened: the prompt ends inside a think block (the
    model starts in its reasoning); header: harmony, the header of a message the prompt
    opened (the model starts in that message's body)."""

    parser: str
    opened: bool = False
    header: str | None = None
    max_calls: int | None = None  # harmony: calls read (1: parallel_tool_calls false, 0: no tools)
    shown: bool = True  # include_reasoning false: the reasoning is split off and dropped
    streamed: bool = True  # stream_reasoning false: streamed in one piece when it ends

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
    if not prompt.endswith(MESSAGE):
        return None
    start = prompt.rfind(START)
    return prompt[start + len(START) : -len(MESSAGE)] if start != -1 else None


def new_parser(plan: ReasoningPlan) -> ReasoningParser:
    if plan.parser == HARMONY:
        return HarmonyParser(plan.header, plan.max_calls)
    return ThinkParser(plan.opened)
