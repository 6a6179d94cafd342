"""Reasoning in /v1/responses: a reasoning output item (its text as reasoning_text content,
as vLLM answers gpt-oss), streamed as response.reasoning_text.delta events; reasoning items
sent back as input (clients return the previous output) are accepted and left out of the
prompt, as a stateless server has nothing to decrypt or replay."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from cpud.frontend.errors import bad_request

REASONING_INPUT_KEYS = frozenset(
    {"type", "id", "summary", "content", "encrypted_content", "status"}
)


class Events(Protocol):
    """What the Responses event stream offers: numbered events and the growing output."""

    answer: Any

    def event(self, kind: str, **data: Any) -> str: ...


def reasoning_item(text: str, status: str = "completed") -> dict:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {
        "type": "reasoning",
        "id": f"rs_{uuid.uuid4().hex}",
        "summary": [],
        "content": content,
        "status": status,
    }


def check_reasoning_input(item: dict, where: str) -> None:
    """A reasoning input item (it adds nothing to the prompt) must still be well formed."""
    extra = sorted(k for k, v in item.items() if k not in REASONING_INPUT_KEYS and v is not None)
    if extra:
        raise bad_request(f"{where}.{extra[0]} is not supported by cpud", f"{where}.{extra[0]}")


@dataclass
class ReasoningEvents:
    """The open reasoning item of a streamed response and its text so far."""

    item: dict | None = None
    index: int = 0  # the open item's place in the output
    pieces: list[str] = field(default_factory=list)

    def delta(self, stream: Events, text: str) -> list[str]:
        chunks = []
        output = stream.answer.output
        if self.item is None:
            self.item = reasoning_item("", "in_progress")
            self.index = len(output)
            output.append(self.item)
            chunks.append(
                stream.event("response.output_item.added", output_index=self.index, item=self.item)
            )
            part = {"type": "reasoning_text", "text": ""}
            chunks.append(
                stream.event(
                    "response.content_part.added",
                    item_id=self.item["id"],
                    output_index=self.index,
                    content_index=0,
                    part=part,
                )
            )
        self.pieces.append(text)
        ids = self._ids()
        chunks.append(stream.event("response.reasoning_text.delta", **ids, delta=text))
        return chunks

    def close(self, stream: Events) -> list[str]:
        """The open item's closing events (none when no item is open)."""
        item = self.item
        if item is None:
            return []
        ids = self._ids()
        text = "".join(self.pieces)
        part = {"type": "reasoning_text", "text": text}
        item["content"], item["status"] = [part], "completed"
        self.item, self.pieces = None, []
        return [
            stream.event("response.reasoning_text.done", **ids, text=text),
            stream.event("response.content_part.done", **ids, part=part),
            stream.event("response.output_item.done", output_index=ids["output_index"], item=item),
        ]

    def _ids(self) -> dict:
        assert self.item is not None
        return {"item_id": self.item["id"], "output_index": self.index, "content_index": 0}
