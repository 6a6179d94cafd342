"""What a reasoning parser hands back for each piece of output it reads, and the parsers'
interface: `feed` takes only the text that is new, `finish` what was held back at the end."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


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

    @property
    def in_reasoning(self) -> bool: ...  # the text read so far ends inside the reasoning

    def feed(self, delta: str) -> Split: ...

    def finish(self, cut: bool) -> Split: ...  # cut: max_tokens ended the output
