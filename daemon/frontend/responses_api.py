"""/v1/responses, stateless: the request becomes a chat completion job (input items as
messages, function tools, text.format as response_format) and its output is answered as a
Response object, or streamed as OpenAI's typed events (response.created, output items,
output_text and function_call_arguments deltas, response.completed)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from cpud.engine.outputs import CompletionOutput, RequestOutput
from cpud.frontend.access_log import AccessNote, access_note
from cpud.frontend.errors import bad_request
from cpud.frontend.jobs import Job, chat_job
from cpud.frontend.openai_api import (
    ENGINE_ERRORS,
    collect_or_abort,
    decoder,
    engine_error,
    start_requests,
)
from cpud.frontend.reasoning_stream import ChatTextStream, read_all
from cpud.frontend.reasoning_tokens import ReasoningTokenCounter, reasoning_token_count
from cpud.frontend.responses_logprobs import chat_fields, token_logprobs, wanted, with_logprobs
from cpud.frontend.responses_reasoning import (
    ReasoningEvents,
    check_reasoning_input,
    reasoning_item,
)
from cpud.frontend.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDef,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    ResponsesRequest,
    Tool,
    ToolCall,
    ToolChoiceFunction,
)
from cpud.frontend.state import ServerState
from cpud.frontend.tool_calls import new_call_id, parse

MESSAGE_KEYS = frozenset({"type", "role", "content", "id", "status"})
CALL_KEYS = frozenset({"type", "call_id", "name", "arguments", "id", "status"})
OUTPUT_KEYS = frozenset({"type", "call_id", "output", "id", "status"})
PART_KEYS = frozenset({"type", "text", "annotations", "logprobs"})
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def _check_keys(item: dict, allowed: frozenset[str], where: str) -> None:
    extra = sorted(k for k, v in item.items() if k not in allowed and v is not None)
    if extra:
        raise bad_request(f"{where}.{extra[0]} is not supported by cpud", f"{where}.{extra[0]}")


def _text(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} must be a string", f"{where}.{key}")
    return value


def _message_text(item: dict, where: str) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of parts", where)
    texts = []
    for k, part in enumerate(content):
        at = f"{where}.content[{k}]"
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
            raise bad_request(f"{at}: only input_text and output_text parts are supported", at)
        _check_keys(part, PART_KEYS, at)
        texts.append(_text(part, "text", at))
    return "\n".join(texts)  # as vLLM joins text parts


def input_messages(body: ResponsesRequest) -> list[ChatMessage]:
    """instructions and input items as chat messages; function_call items join the
    assistant message before them, function_call_output items become tool messages."""
    messages = []
    if body.instructions:
        messages.append(ChatMessage(role="system", content=body.instructions))
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    for index, item in enumerate(items):
        where = f"input[{index}]"
        kind = item.get("type", "message")
        if kind == "message":
            _check_keys(item, MESSAGE_KEYS, where)
            given = item.get("role")
            role = ROLES.get(given) if isinstance(given, str) else None
            if role is None:
                raise bad_request(
                    f"{where}.role must be one of {', '.join(ROLES)}", f"{where}.role"
                )
            messages.append(ChatMessage(role=role, content=_message_text(item, where)))
        elif kind == "function_call":
            _check_keys(item, CALL_KEYS, where)
            call = ToolCall(
                id=_text(item, "call_id", where),
                function=FunctionCall(
                    name=_text(item, "name", where), arguments=_text(item, "arguments", where)
                ),
            )
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "reasoning":
            check_reasoning_input(item, where)
        elif kind == "function_call_output":
            _check_keys(item, OUTPUT_KEYS, where)
            messages.append(
                ChatMessage(
                    role="tool",
                    content=_text(item, "output", where),
                    tool_call_id=_text(item, "call_id", where),
                )
            )
        else:
            raise bad_request(f"{where}.type {kind!r} is not supported by cpud", f"{where}.type")
    return messages


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    if body.store:
        raise bad_request("store: true is not supported: cpud stores no responses", "store")
    if body.previous_response_id is not None:
        raise bad_request(
            "previous_response_id is not supported: cpud keeps no responses; send the whole "
            "conversation as input",
            "previous_response_id",
        )
    tools = [
        Tool(
            type="function",
            function=FunctionDef(
                name=t.name, description=t.description, parameters=t.parameters, strict=t.strict
            ),
        )
        for t in body.tools or ()
    ]
    choice: Any = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = NamedToolChoice(type="function", function=ToolChoiceFunction(name=choice.name))
    response_format = None
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type != "text":
        schema = None
        if fmt.type == "json_schema":
            schema = JsonSchemaFormat(
                name=fmt.name, schema=fmt.schema, strict=fmt.strict, description=fmt.description
            )
        response_format = ResponseFormat(type=fmt.type, json_schema=schema)
    extra = chat_fields(body)
    if body.temperature is not None:
        extra["temperature"] = body.temperature
    if body.top_p is not None:
        extra["top_p"] = body.top_p
    if body.reasoning is not None and body.reasoning.effort is not None:
        extra["reasoning_effort"] = body.reasoning.effort
    return ChatCompletionRequest(
        model=body.model,
        messages=input_messages(body),
        max_completion_tokens=body.max_output_tokens,
        tools=tools or None,
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=response_format,
        stream=body.stream,
        user=body.user,
        cache_salt=body.cache_salt,
        **extra,
    )


@dataclass
class Answer:
    """The Response object as it builds up."""

    body: ResponsesRequest
    job: Job
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))
    output: list[dict] = field(default_factory=list)
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    note: AccessNote = field(default_factory=AccessNote)  # the request's access line
    # report the prompt tokens the prefix cache served (else 0: a Response always has
    # input_tokens_details)
    details: bool = True

    def snapshot(self, status: str, reason: str | None = None) -> dict:
        body = self.body
        incomplete = None
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens"}
        fmt = body.text.format if body.text is not None and body.text.format else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.job.model,
            "output": self.output,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": _reasoning_json(body),
            "store": False,
            "temperature": body.temperature if body.temperature is not None else 1.0,
            "text": {"format": _format_json(fmt)},
            "tool_choice": _tool_choice_json(body.tool_choice),
            "tools": [_tool_json(t) for t in body.tools or ()],
            "top_p": body.top_p if body.top_p is not None else 1.0,
            "truncation": "disabled",
            "usage": None if status == "in_progress" else self.usage(),
            "metadata": body.metadata or {},
        }

    def usage(self) -> dict:
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": self.input_tokens + self.output_tokens,
        }

    def measure(self, final: RequestOutput, output_tokens: int, reasoning_tokens: int) -> None:
        self.input_tokens = len(final.prompt_token_ids)
        self.cached_tokens = final.num_cached_tokens if self.details else 0
        self.output_tokens = output_tokens
        self.reasoning_tokens = reasoning_tokens
        self.note.prompt_tokens = self.input_tokens
        self.note.completion_tokens = self.output_tokens


def _reasoning_json(body: ResponsesRequest) -> dict | None:
    effort = body.reasoning.effort if body.reasoning is not None else None
    return None if effort is None else {"effort": effort, "summary": None}


def _format_json(fmt: Any) -> dict:
    if fmt is None:
        return {"type": "text"}
    data = {"type": fmt.type}
    if fmt.type == "json_schema":
        data.update(name=fmt.name, schema=fmt.schema, strict=fmt.strict)
        if fmt.description is not None:
            data["description"] = fmt.description
    return data


def _tool_choice_json(choice: Any) -> Any:
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else {"type": "function", "name": choice.name}


def _tool_json(tool: Any) -> dict:
    return {
        "type": "function",
        "name": tool.name,
        "description": tool.description,
        "parameters": tool.parameters,
        "strict": tool.strict,
    }


def message_item(text: str, status: str = "completed") -> dict:
    return {
        "type": "message",
        "id": f"msg_{uuid.uuid4().hex}",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}] if text else [],
    }


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _status(out: CompletionOutput) -> str:
    return "incomplete" if out.finish_reason == "length" else "completed"


async def respond_responses(
    state: ServerState, request: Request, body: ResponsesRequest
) -> Response:
    job = await state.off_loop(lambda: chat_job(state, chat_request(body)))
    streams = await start_requests(
        state, job.request_id, job.prompts, job.params, request, job.reasoning_budget
    )
    details = state.config.prompt_tokens_details
    answer = Answer(body, job, note=access_note(request), details=details)
    answer.note.request_id, answer.note.model = answer.id, job.model
    if body.stream:
        counter = (
            None if job.reasoning is None else ReasoningTokenCounter(job.reasoning, decoder(state))
        )
        return StreamingResponse(
            EventStream(answer, counter=counter).events(streams[0]),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    final = (await collect_or_abort(request, streams))[0]
    out = final.outputs[0]
    decode = decoder(state)
    answer.measure(
        final, len(out.token_ids), reasoning_token_count(job.reasoning, out.token_ids, decode)
    )
    cut = out.finish_reason == "length"
    read = read_all(job.reasoning, out.text, cut)
    if read.reasoning:
        answer.output.append(reasoning_item(read.reasoning))
    text = read.content or ""
    parsed = None
    if job.tool_parser:
        parsed = parse(text, job.tool_parser, job.parallel_tool_calls, cut)
    if parsed is not None and (parsed.calls or parsed.content != (text or None)):
        if parsed.content:
            answer.output.append(message_item(parsed.content))
        for call in parsed.calls:
            answer.output.append(call_item(new_call_id(), call.name, call.arguments))
    elif wanted(body):
        logprobs = token_logprobs(out, 0, job.top_logprobs)
        answer.output.append(with_logprobs(message_item(text), logprobs))
    elif text or not (read.reasoning or read.calls):
        answer.output.append(message_item(text))
    for call in read.calls:  # the format's own calls (harmony)
        answer.output.append(call_item(new_call_id(), call.name, call.arguments))
    return JSONResponse(answer.snapshot(_status(out)))


@dataclass
class EventStream:
    """OpenAI's Responses streaming events for one output: a message item while text comes,
    a function_call item per call."""

    answer: Answer
    sequence: int = 0
    message: dict | None = None
    pieces: list[str] = field(default_factory=list)  # the message's text, joined at its end
    calls: dict[int, dict] = field(default_factory=dict)
    reasoning: ReasoningEvents = field(default_factory=ReasoningEvents)
    positions: dict[str, int] = field(default_factory=dict)  # output index by item id
    logprobs: list[dict] = field(default_factory=list)  # of the text sent (when included)
    tokens: int = 0  # output tokens so far
    counter: ReasoningTokenCounter | None = None  # of reasoning tokens, when split off
    # Tokens (with their logprob entries) whose text is held back: their logprobs go out
    # with the next text.
    held_tokens: list[int] = field(default_factory=list)
    held_logprobs: list[dict] = field(default_factory=list)

    def event(self, kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    async def events(self, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        answer = self.answer
        single = None if answer.job.parallel_tool_calls else 1
        reader = ChatTextStream(answer.job.reasoning, answer.job.tool_parser, single)
        yield self.event("response.created", response=answer.snapshot("in_progress"))
        yield self.event("response.in_progress", response=answer.snapshot("in_progress"))
        try:
            final = out = None
            async for final in stream:
                out = final.outputs[0]
                done = out.finish_reason is not None
                self.hold(out)
                news = reader.feed(out.text, done, out.finish_reason == "length")
                if news.reasoning:
                    for chunk in self.reasoning_delta(news.reasoning):
                        yield chunk
                content, deltas = news.content, news.calls
                if content:
                    for chunk in self.text_delta(content, self.new_logprobs(out)):
                        yield chunk
                for delta in deltas:
                    for chunk in self.call_delta(delta):
                        yield chunk
            if final is None or out is None:
                raise RuntimeError("the engine ended the request without an output")
            if self.message is not None:  # tokens with no text of their own (the end token)
                self.logprobs += self.new_logprobs(out)
            for chunk in self.close_items():
                yield chunk
            answer.measure(final, self.tokens, self.counter.count if self.counter else 0)
            kind = "response.incomplete" if _status(out) == "incomplete" else "response.completed"
            yield self.event(kind, response=answer.snapshot(_status(out)))
        except ENGINE_ERRORS as exc:
            error = engine_error(exc)
            answer.note.error = f"{error.code}: {error.message}"
            yield self.event("error", code=error.code, message=error.message, param=error.param)
        except Exception as exc:
            answer.note.error = f"internal_error: {type(exc).__name__}: {exc}"
            answer.note.failed = True
            message = f"internal error ({type(exc).__name__}); the server logged it"
            yield self.event("error", code="internal_error", message=message, param=None)

    def hold(self, out: CompletionOutput) -> None:
        """Count an output's new tokens and keep their logprob entries until text goes out."""
        self.tokens += len(out.token_ids)
        if self.counter is not None:
            self.counter.feed(out.token_ids)
        if wanted(self.answer.body):
            self.held_tokens += out.token_ids
            self.held_logprobs += out.logprobs or []

    def new_logprobs(self, out: CompletionOutput) -> list[dict]:
        """The logprobs of the tokens held so far (handed out: no longer held)."""
        if not wanted(self.answer.body):
            return []
        held = CompletionOutput(0, "", self.held_tokens, None, self.held_logprobs)
        self.held_tokens, self.held_logprobs = [], []
        return token_logprobs(held, 0, self.answer.job.top_logprobs)

    def reasoning_delta(self, text: str) -> list[str]:
        """Reasoning after an answer began closes that message: later text opens another."""
        chunks = self.close_message()
        if self.message is not None:
            self.message, self.pieces, self.logprobs = None, [], []
        return chunks + self.reasoning.delta(self, text)

    def text_delta(self, content: str, logprobs: list[dict]) -> list[str]:
        chunks = self.reasoning.close(self)
        index = len(self.answer.output)
        if self.message is None:
            self.message = message_item("", "in_progress")
            self.positions[self.message["id"]] = index
            self.answer.output.append(self.message)
            chunks.append(
                self.event("response.output_item.added", output_index=index, item=self.message)
            )
            part = {"type": "output_text", "text": "", "annotations": []}
            chunks.append(
                self.event(
                    "response.content_part.added",
                    item_id=self.message["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
        self.pieces.append(content)
        self.logprobs += logprobs
        chunks.append(
            self.event(
                "response.output_text.delta",
                item_id=self.message["id"],
                output_index=self.positions[self.message["id"]],
                content_index=0,
                delta=content,
                logprobs=logprobs,
            )
        )
        return chunks

    def call_delta(self, delta: dict) -> list[str]:
        chunks = self.reasoning.close(self)
        fn = delta["function"]
        if "id" in delta:
            chunks += self.close_message()
            item = call_item(delta["id"], fn["name"], "", "in_progress")
            self.calls[delta["index"]] = item
            self.positions[item["id"]] = len(self.answer.output)
            self.answer.output.append(item)
            index = len(self.answer.output) - 1
            chunks.append(self.event("response.output_item.added", output_index=index, item=item))
        item = self.calls[delta["index"]]
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            chunks.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self.positions[item["id"]],
                    delta=fn["arguments"],
                )
            )
        return chunks

    def close_message(self) -> list[str]:
        message = self.message
        if message is None or message["status"] == "completed":
            return []
        index = self.answer.output.index(message)
        text = "".join(self.pieces)
        part = {"type": "output_text", "text": text, "annotations": []}
        if wanted(self.answer.body):
            part["logprobs"] = self.logprobs
        message["content"] = [part]
        message["status"] = "completed"
        ids = {"item_id": message["id"], "output_index": index, "content_index": 0}
        return [
            self.event("response.output_text.done", **ids, text=text, logprobs=self.logprobs),
            self.event("response.content_part.done", **ids, part=part),
            self.event("response.output_item.done", output_index=index, item=message),
        ]

    def close_items(self) -> list[str]:
        chunks = self.reasoning.close(self) + self.close_message()
        for item in self.calls.values():
            index = self.answer.output.index(item)
            item["status"] = "completed"
            chunks.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )
            )
            chunks.append(self.event("response.output_item.done", output_index=index, item=item))
        if not self.answer.output:
            self.answer.output.append(message_item(""))
        return chunks
