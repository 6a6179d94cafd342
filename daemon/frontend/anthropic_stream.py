"""A Messages answer streamed as Anthropic's server-sent events: message_start, ping, then
per content block content_block_start / content_block_delta (thinking_delta for the model's
reasoning, text_delta, or input_json_delta for tool_use) / content_block_stop, message_delta
with the stop reason and usage, and message_stop. An engine failure mid-stream is an `error`
event."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from cpud.engine.outputs import RequestOutput
from cpud.frontend.access_log import AccessNote
from cpud.frontend.anthropic_answer import (
    error_type,
    message_json,
    stop_reason,
    text_block,
    thinking_block,
    tool_use_block,
    usage_json,
)
from cpud.frontend.jobs import Job
from cpud.frontend.openai_api import ENGINE_ERRORS, engine_error
from cpud.frontend.reasoning_stream import ChatTextStream


def event(kind: str, **data: Any) -> str:
    # ASCII-only JSON, as the other streams send it: no line separators inside a data line.
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


@dataclass
class MessageStream:
    """The events of one Messages answer; text and tool calls become content blocks in the
    order the model writes them."""

    job: Job
    note: AccessNote
    details: bool  # report the prompt tokens the prefix cache served
    started: int = 0  # content blocks started
    open_kind: str | None = None  # the kind of the block still open
    call_blocks: dict[int, int] = field(default_factory=dict)  # tool call index -> block index

    async def events(self, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        job = self.job
        single = None if job.parallel_tool_calls else 1
        reader = ChatTextStream(job.reasoning, job.tool_parser, single)
        final = out = None
        tokens = 0
        try:
            async for final in stream:
                if out is None:
                    yield self.start_event(final)
                    yield event("ping")
                out = final.outputs[0]
                done, cut = out.finish_reason is not None, out.finish_reason == "length"
                news = reader.feed(out.text, done, cut)
                for chunk in self.thinking(news.reasoning):
                    yield chunk
                content, deltas = news.content, news.calls
                for chunk in self.text(content):
                    yield chunk
                for delta in deltas:
                    for chunk in self.call(delta):
                        yield chunk
                tokens += len(out.token_ids)
                self.note.completion_tokens = tokens
            if final is None or out is None:
                raise RuntimeError("the engine ended the request without an output")
            for chunk in self.close():
                yield chunk
            reason, sequence = stop_reason(out, bool(self.call_blocks))
            usage = {"output_tokens": tokens}
            yield event(
                "message_delta",
                delta={"stop_reason": reason, "stop_sequence": sequence},
                usage=usage,
            )
            yield event("message_stop")
        except ENGINE_ERRORS as exc:
            error = engine_error(exc)
            self.note.error = f"{error.code}: {error.message}"
            body = {"type": error_type(error.status), "message": error.message}
            yield event("error", error=body)
        except Exception as exc:
            self.note.error = f"internal_error: {type(exc).__name__}: {exc}"
            self.note.failed = True
            message = f"internal error ({type(exc).__name__}); the server logged it"
            yield event("error", error={"type": "api_error", "message": message})

    def start_event(self, first: RequestOutput) -> str:
        """message_start, sent with the first output: the prompt's cached tokens are known."""
        job = self.job
        cached = first.num_cached_tokens if self.details else 0
        usage = usage_json(len(first.prompt_token_ids), cached, 0)
        message = message_json(job.request_id, job.model, [], (None, None), usage)
        return event("message_start", message=message)

    def begin(self, block: dict) -> str:
        self.open_kind = block["type"]
        self.started += 1
        return event("content_block_start", index=self.started - 1, content_block=block)

    def close(self) -> list[str]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [event("content_block_stop", index=self.started - 1)]

    def text(self, content: str) -> list[str]:
        if not content:
            return []
        chunks = []
        if self.open_kind != "text":
            chunks += self.close()
            chunks.append(self.begin(text_block("")))
        delta = {"type": "text_delta", "text": content}
        chunks.append(event("content_block_delta", index=self.started - 1, delta=delta))
        return chunks

    def thinking(self, text: str) -> list[str]:
        if not text:
            return []
        chunks = []
        if self.open_kind != "thinking":
            chunks += self.close()
            chunks.append(self.begin(thinking_block("")))
        delta = {"type": "thinking_delta", "thinking": text}
        chunks.append(event("content_block_delta", index=self.started - 1, delta=delta))
        return chunks

    def call(self, delta: dict) -> list[str]:
        """A tool-call delta of ToolCallStream: its first starts a tool_use block, the
        argument fragments that follow are input_json_delta events of that block."""
        chunks = []
        function = delta["function"]
        if "id" in delta:
            chunks += self.close()
            chunks.append(self.begin(tool_use_block(function["name"], {})))
            self.call_blocks[delta["index"]] = self.started - 1
        fragment = function.get("arguments")
        if fragment:
            index = self.call_blocks[delta["index"]]
            json_delta = {"type": "input_json_delta", "partial_json": fragment}
            chunks.append(event("content_block_delta", index=index, delta=json_delta))
        return chunks
