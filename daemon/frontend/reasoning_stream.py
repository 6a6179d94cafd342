"""One chat choice's output read as it grows: the reasoning split off (a reasoning parser)
and the answer read for tool calls (a tool-call parser), or the format's own calls. `feed`
takes only the text that is new; `read_all` reads a finished output the same way, so a
streamed answer and a whole one always agree."""

from __future__ import annotations

from dataclasses import dataclass, field

from cpud.frontend.reasoning import ReasoningPlan, new_parser
from cpud.frontend.reasoning_split import ReasoningParser, Split
from cpud.frontend.tool_calls import ParsedCall, ToolCallStream


class ChatTextStream:
    def __init__(self, plan: ReasoningPlan | None, tool_parser: str | None, max_calls: int | None):
        self.reasoning: ReasoningParser | None = None if plan is None else new_parser(plan)
        self.shown = plan is None or plan.shown
        self.streamed = plan is None or plan.streamed
        self.held_reasoning = ""  # not streamed: the reasoning so far, sent when it ends
        self.tools: ToolCallStream | None = None
        if tool_parser is not None and (plan is None or not plan.reads_calls):
            self.tools = ToolCallStream(tool_parser, max_calls)

    @property
    def called(self) -> bool:
        tools_called = self.tools is not None and self.tools.called
        return tools_called or (self.reasoning is not None and self.reasoning.called)

    def feed(self, delta: str, finished: bool, cut: bool = False) -> Split:
        """The news in `delta` (and, when `finished`, everything held back); `cut`: max_tokens
        ended the output."""
        if self.reasoning is None:
            news = Split(content=delta)
        else:
            news = self.reasoning.feed(delta)
            if finished:
                news.extend(self.reasoning.finish(cut))
            if not self.shown:
                news.reasoning = ""
            elif not self.streamed:
                self.held_reasoning += news.reasoning
                ended = finished or not self.reasoning.in_reasoning
                news.reasoning = self.held_reasoning if ended else ""
                self.held_reasoning = "" if ended else self.held_reasoning
        if self.tools is None or not (news.content or finished):
            return news
        news.content, calls = self.tools.feed_delta(news.content, finished)
        news.calls += calls
        return news


@dataclass
class ReadOutput:
    """A finished output: its reasoning (None if none), answer (None if empty) and calls."""

    reasoning: str | None
    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


def read_all(plan: ReasoningPlan | None, text: str, cut: bool) -> ReadOutput:
    """A finished output's reasoning, answer and the format's own tool calls (the answer is
    not read for other tool-call formats here: tool_calls.parse does that)."""
    if plan is None:
        return ReadOutput(None, text or None)
    parser = new_parser(plan)
    split = parser.feed(text).extend(parser.finish(cut))
    calls: dict[int, list[str]] = {}
    for delta in split.calls:
        function = delta["function"]
        if "name" in function:
            calls[delta["index"]] = [function["name"], ""]
        calls[delta["index"]][1] += function.get("arguments", "")
    parsed = [ParsedCall(name, arguments) for name, arguments in calls.values()]
    reasoning = split.reasoning if plan.shown else ""
    return ReadOutput(reasoning or None, split.content or None, parsed)


def reasoning_fields(reasoning: str | None) -> dict:
    """The reasoning as a chat message or delta carries it: vLLM's `reasoning` and its
    earlier name `reasoning_content`, which clients still read."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}
