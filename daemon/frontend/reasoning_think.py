"""Think blocks (`<think>reasoning</think>answer`: Qwen3, DeepSeek-R1, SmolLM3) read as the
output grows."""

from __future__ import annotations

from cpud.frontend.reasoning_split import Split
from cpud.frontend.tool_call_scan import held_suffix

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


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

    @property
    def in_reasoning(self) -> bool:
        return self.state == "reasoning" or (self.state == "start" and self.opened)

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
