"""/v1/completions and /v1/chat/completions: run requests on the engine, answer in OpenAI's
shapes, stream as server-sent events (one event per step that produced text). The engine's
outputs are deltas: a stream forwards each one's news, a whole answer folds them once
(OutputAccumulator). Chat output is read for tool calls when the request has tools:
message.tool_calls, or streamed tool-call deltas, with finish_reason "tool_calls"."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from cpud.engine.admission import Admission
from cpud.engine.llm_engine import RequestFailedError
from cpud.engine.outputs import CompletionOutput, OutputAccumulator, RequestOutput
from cpud.engine.sampling_params import SamplingParams
from cpud.frontend.access_log import AccessNote, access_note
from cpud.frontend.async_engine import EngineDeadError, QueueFullError, StoppingError
from cpud.frontend.constraints import while_connected
from cpud.frontend.errors import APIError, bad_request
from cpud.frontend.jobs import Job
from cpud.frontend.logprobs import (
    chat_logprobs,
    completion_logprobs,
    joined,
    legacy_logprobs,
    prompt_logprobs_json,
)
from cpud.frontend.reasoning_budget import ReasoningBudget
from cpud.frontend.reasoning_stream import ChatTextStream, read_all, reasoning_fields
from cpud.frontend.reasoning_tokens import ReasoningTokenCounter, reasoning_token_count
from cpud.frontend.requests import Prompt, check_kv_room
from cpud.frontend.state import ServerState
from cpud.frontend.tool_calls import new_call_id, parse
from cpud.frontend.usage import Usage
from cpud.settings.errors import RequestError

ENGINE_ERRORS = (RequestError, QueueFullError, EngineDeadError, RequestFailedError, StoppingError)


@dataclass
class Choice:
    """What has been sent so far for one choice of one prompt."""

    index: int
    offset: int = 0  # text_offset of the next token's logprobs (as the full response counts)
    started: bool = False
    finished: bool = False
    tool_stream: ChatTextStream | None = None  # reasoning and tool calls read off the text
    # Tokens (and their logprob entries) whose text is held back: they go with the next text.
    held_tokens: list[int] = field(default_factory=list)
    held_logprobs: list[dict] = field(default_factory=list)


def engine_error(exc: Exception) -> APIError:
    if isinstance(exc, RequestError):
        return bad_request(str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), "rate_limit_error", None, "queue_full", {"Retry-After": "1"})
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), "service_unavailable", None, "engine_dead")
    if isinstance(exc, StoppingError):
        return APIError(503, str(exc), "service_unavailable", None, exc.code, {"Retry-After": "5"})
    if isinstance(exc, RequestFailedError):
        return APIError(500, str(exc), "internal_error", None, "request_failed")
    raise exc


async def start_requests(
    state: ServerState,
    base_id: str,
    prompts: list[Prompt],
    params: SamplingParams,
    request: Request | None = None,
    budget: ReasoningBudget | None = None,
) -> list[AsyncIterator[RequestOutput]]:
    """Validate every prompt before anything runs, then start one engine request each with
    what its validation found. A server that would not admit them says so first (a stream
    gets the status, not an error event). A client that leaves during validation ends it.
    `budget`: a cap on the outputs' reasoning, in the constraint slot an unconstrained
    output leaves free."""
    try:
        state.engine.check_admission()
        admitted = await while_connected(request, validate_all(state, prompts, params))
        state.engine.check_admission()
    except ENGINE_ERRORS as exc:
        raise engine_error(exc) from None
    if budget is not None:
        admitted = [a if a.grammar is not None else replace(a, grammar=budget) for a in admitted]
    return [
        observed(state, state.engine.generate(f"{base_id}-{i}", admission, p.text))
        for i, (p, admission) in enumerate(zip(prompts, admitted))
    ]


async def validate_all(
    state: ServerState, prompts: list[Prompt], params: SamplingParams
) -> list[Admission]:
    admitted = [await state.engine.validate(p.token_ids, params) for p in prompts]
    for admission in admitted:
        check_kv_room(state, admission)
    return admitted


async def observed(
    state: ServerState, stream: AsyncIterator[RequestOutput]
) -> AsyncIterator[RequestOutput]:
    """Pass outputs through, feeding the TTFT / inter-token / end-to-end histograms."""
    metrics = state.metrics
    arrival = last = time.monotonic()
    tokens = 0
    async for out in stream:
        now = time.monotonic()
        new = sum(len(o.token_ids) for o in out.outputs)
        if new:
            if tokens == 0:
                metrics.ttft.observe(now - arrival)
            else:
                metrics.inter_token.observe((now - last) / new)
            tokens, last = tokens + new, now
        if out.finished:
            metrics.e2e.observe(now - arrival)
            metrics.prompt_tokens.inc(len(out.prompt_token_ids))
            metrics.generation_tokens.inc(tokens)
        yield out


async def merged(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several engine requests as they come, tagged with the prompt index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((index, out))
        except BaseException as exc:  # forwarded to the consumer
            await queue.put((index, exc))
        finally:
            await queue.put((index, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect_or_abort(
    request: Request, streams: list[AsyncIterator[RequestOutput]]
) -> list[RequestOutput]:
    """Whole outputs of every stream (deltas folded as they come); a client that disconnects
    cancels (and so aborts) all. An embedding stream's one output is its whole output."""
    finals: dict[int, Any] = {}
    folds: dict[int, OutputAccumulator] = {}

    async def consume() -> None:
        async for index, out in merged(streams):
            if not isinstance(out, RequestOutput):
                finals[index] = out
                continue
            fold = folds.setdefault(index, OutputAccumulator())
            fold.add(out)
            if out.finished:
                finals[index] = fold.result()

    task = asyncio.create_task(consume())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                raise APIError(499, "client disconnected", "client_closed_request")
    except BaseException:  # the client left, or this handler was cancelled
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # its outcome, whatever it was
        raise
    try:
        task.result()
    except ENGINE_ERRORS as exc:
        raise engine_error(exc) from None
    return [finals[i] for i in range(len(streams))]


def sse(data: dict | str) -> str:
    # ASCII-only JSON: U+2028 / U+0085 inside generated text would otherwise be split as line
    # breaks by clients that use str.splitlines() on the event stream.
    payload = data if isinstance(data, str) else json.dumps(data)
    return f"data: {payload}\n\n"


def finish_reason(output: CompletionOutput) -> str | None:
    reason = output.finish_reason
    return None if reason is None else ("stop" if reason == "abort" else reason)


# ---- the two endpoints ----------------------------------------------------------------------


def prompt_text(state: ServerState, prompt: Prompt) -> str:
    if prompt.text is not None:
        return prompt.text
    return state.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)  # as given


async def respond(state: ServerState, request: Request, job: Job) -> Response:
    streams = await start_requests(
        state, job.request_id, job.prompts, job.params, request, job.reasoning_budget
    )
    note = access_note(request)
    note.request_id, note.model = job.request_id, job.model
    note.prompt_tokens = sum(len(p.token_ids) for p in job.prompts)
    if job.stream:
        return StreamingResponse(
            stream_events(state, job, streams, note),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    finals = await collect_or_abort(request, streams)
    usage = Usage(
        prompt_tokens=sum(len(p.token_ids) for p in job.prompts),
        cached_tokens=sum(f.num_cached_tokens for f in finals),
        details=state.config.prompt_tokens_details,
    )
    if job.reasoning is not None:
        decode = decoder(state)
        usage.reasoning_tokens = sum(
            reasoning_token_count(job.reasoning, out.token_ids, decode)
            for final in finals
            for out in final.outputs
        )
    choices = []
    for p_index, (prompt, final) in enumerate(zip(job.prompts, finals)):
        for out in final.outputs:
            usage.completion_tokens += len(out.token_ids)
            index = p_index * job.params.n + out.index
            choices.append(full_choice(state, job, prompt, final, index, out))
    note.completion_tokens = usage.completion_tokens
    body = {
        "id": job.request_id,
        "object": "text_completion" if job.kind == "completion" else "chat.completion",
        "created": job.created,
        "model": job.model,
        "choices": choices,
        "usage": usage.as_dict(),
    }
    if job.kind == "chat" and job.params.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_json(finals[0].prompt_logprobs)
    return JSONResponse(body)


def decoder(state: ServerState) -> Callable[[int], str]:
    return lambda token: state.tokenizer.decode([token], skip_special_tokens=False)


def echoed_logprobs(state: ServerState, job: Job, prompt: Prompt, output: RequestOutput) -> dict:
    """The legacy logprobs of the echoed prompt (the first token has none)."""
    if output.prompt_logprobs is None:
        raise RuntimeError("the engine returned no prompt logprobs for an echo with logprobs")
    return legacy_logprobs(
        prompt.token_ids, output.prompt_logprobs, 0, job.top_logprobs, decoder(state)
    )


def full_choice(
    state: ServerState,
    job: Job,
    prompt: Prompt,
    final: RequestOutput,
    index: int,
    out: CompletionOutput,
) -> dict:
    wants_logprobs = job.params.logprobs is not None
    if job.kind == "completion":
        prefix = prompt_text(state, prompt) if job.echo else ""
        logprobs = None
        if wants_logprobs:
            if job.prompt_only:
                logprobs = echoed_logprobs(state, job, prompt, final)
            else:
                logprobs = completion_logprobs(out, 0, len(prefix), job.top_logprobs)
                if job.echo:
                    logprobs = joined(echoed_logprobs(state, job, prompt, final), logprobs)
        choice = {
            "index": index,
            "text": prefix if job.prompt_only else prefix + out.text,
            "logprobs": logprobs,
            "finish_reason": finish_reason(out),
            "stop_reason": out.stop_reason,
        }
        if job.params.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(final.prompt_logprobs)
        return choice
    message: dict = {"role": "assistant", "content": out.text}
    reason = finish_reason(out)
    text, calls = out.text, []
    if job.reasoning is not None:
        read = read_all(job.reasoning, out.text, reason == "length")
        message.update(content=read.content, **reasoning_fields(read.reasoning))
        text, calls = read.content or "", read.calls
    if job.tool_parser is not None:
        cut = reason == "length"
        parsed = parse(text, job.tool_parser, job.parallel_tool_calls, cut)
        if parsed.calls or parsed.content != (text or None):
            message["content"] = parsed.content
        calls = parsed.calls
    if calls:
        message["tool_calls"] = [
            {
                "id": new_call_id(),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in calls
        ]
        reason = "tool_calls" if reason == "stop" else reason
    if job.answer_prefix:
        message["content"] = job.answer_prefix + (message["content"] or "")
    return {
        "index": index,
        "message": message,
        "logprobs": chat_logprobs(out, 0, job.top_logprobs) if wants_logprobs else None,
        "finish_reason": reason,
        "stop_reason": out.stop_reason,
    }


def tool_stream(job: Job) -> ChatTextStream | None:
    if job.tool_parser is None and job.reasoning is None:
        return None
    max_calls = None if job.parallel_tool_calls else 1
    return ChatTextStream(job.reasoning, job.tool_parser, max_calls)


async def stream_events(
    state: ServerState,
    job: Job,
    streams: list[AsyncIterator[RequestOutput]],
    note: AccessNote | None = None,
) -> AsyncIterator[str]:
    note = note or AccessNote()
    n = job.params.n
    choices = {
        (p, i): Choice(p * n + i, tool_stream=tool_stream(job))
        for p in range(len(job.prompts))
        for i in range(n)
    }
    usage = Usage(
        prompt_tokens=sum(len(p.token_ids) for p in job.prompts),
        details=state.config.prompt_tokens_details,
    )
    cached: dict[int, int] = {}
    generated: dict[tuple[int, int], int] = {}
    reasoning: dict[tuple[int, int], ReasoningTokenCounter] = {}
    object_name = "text_completion" if job.kind == "completion" else "chat.completion.chunk"

    def current_usage() -> dict:
        usage.completion_tokens = sum(generated.values())
        usage.cached_tokens = sum(cached.values())
        if job.reasoning is not None:
            usage.reasoning_tokens = sum(counter.count for counter in reasoning.values())
        return usage.as_dict()

    def chunk(choice_rows: list[dict]) -> str:
        body = {
            "id": job.request_id,
            "object": object_name,
            "created": job.created,
            "model": job.model,
            "choices": choice_rows,
        }
        if job.include_usage:
            body["usage"] = current_usage() if job.continuous_usage else None
        return sse(body)

    def make_row(
        choice: Choice, p_index: int, output: RequestOutput, out: CompletionOutput
    ) -> dict | None:
        if job.kind == "completion":
            return completion_delta(state, job, choice, job.prompts[p_index], output, out)
        return chat_delta(job, choice, out)

    try:
        async for p_index, output in merged(streams):
            cached[p_index] = output.num_cached_tokens
            rows = []
            for out in output.outputs:
                key = (p_index, out.index)
                generated[key] = generated.get(key, 0) + len(out.token_ids)
                if job.reasoning is not None and job.include_usage:
                    if key not in reasoning:
                        reasoning[key] = ReasoningTokenCounter(job.reasoning, decoder(state))
                    reasoning[key].feed(out.token_ids)
                choice = choices[(p_index, out.index)]
                if choice.finished:
                    continue
                row = make_row(choice, p_index, output, out)
                if row is not None:
                    rows.append(row)
            if rows:
                yield chunk(rows)
        if job.include_usage:
            yield sse(
                {
                    "id": job.request_id,
                    "object": object_name,
                    "created": job.created,
                    "model": job.model,
                    "choices": [],
                    "usage": current_usage(),
                }
            )
    except ENGINE_ERRORS as exc:
        error = engine_error(exc)
        note.error = f"{error.code}: {error.message}"
        yield sse({"error": {"message": error.message, "type": error.type, "code": error.code}})
    except Exception as exc:
        note.error = f"internal_error: {type(exc).__name__}: {exc}"
        note.failed = True
        message = f"internal error ({type(exc).__name__}); the server logged it"
        error = {"message": message, "type": "internal_error", "code": "internal_error"}
        yield sse({"error": error})
    finally:
        note.completion_tokens = sum(generated.values())
    yield sse("[DONE]")


def _advance(
    choice: Choice, out: CompletionOutput, send_anyway: bool = False
) -> tuple[str, CompletionOutput, str | None] | None:
    """(new text, the tokens to send with it, finish reason), marked as sent; None while the
    new tokens' text is held back (partial UTF-8, a possible stop string): they go out with
    the next chunk, logprobs included."""
    choice.held_tokens += out.token_ids
    if out.logprobs:
        choice.held_logprobs += out.logprobs
    reason = finish_reason(out)
    if not out.text and reason is None and not send_anyway:
        return None
    sent = CompletionOutput(
        out.index,
        out.text,
        choice.held_tokens,
        out.cumulative_logprob,
        choice.held_logprobs if out.logprobs is not None else None,
        out.finish_reason,
        out.stop_reason,
    )
    choice.held_tokens, choice.held_logprobs = [], []
    choice.finished = reason is not None
    return out.text, sent, reason


def completion_delta(
    state: ServerState,
    job: Job,
    choice: Choice,
    prompt: Prompt,
    output: RequestOutput,
    out: CompletionOutput,
) -> dict | None:
    echoing = job.echo and not choice.started
    prefix = prompt_text(state, prompt) if echoing else ""
    if echoing:
        choice.offset = len(prefix)
    advanced = _advance(choice, out, send_anyway=echoing)
    if advanced is None:
        return None
    text, sent, reason = advanced
    choice.started = True
    logprobs = None
    if job.params.logprobs is not None:
        logprobs = completion_logprobs(sent, 0, choice.offset, job.top_logprobs)
        choice.offset += sum(len(token) for token in logprobs["tokens"])
        if job.prompt_only:
            logprobs = echoed_logprobs(state, job, prompt, output) if echoing else None
        elif echoing:
            logprobs = joined(echoed_logprobs(state, job, prompt, output), logprobs)
    if job.prompt_only:
        text = ""
    return {
        "index": choice.index,
        "text": prefix + text,
        "logprobs": logprobs,
        "finish_reason": reason,
        "stop_reason": out.stop_reason if reason else None,
    }


def chat_delta(job: Job, choice: Choice, out: CompletionOutput) -> dict | None:
    advanced = _advance(choice, out)
    if advanced is None:
        return None
    text, sent, reason = advanced
    delta: dict = {}
    echoed = "" if choice.started else job.answer_prefix
    if not choice.started:
        delta["role"] = "assistant"
        choice.started = True
    if choice.tool_stream is not None:
        news = choice.tool_stream.feed(text, reason is not None, reason == "length")
        text = news.content
        if news.reasoning:
            delta.update(reasoning_fields(news.reasoning))
        if news.calls:
            delta["tool_calls"] = news.calls
        if reason == "stop" and choice.tool_stream.called:
            reason = "tool_calls"
    if text or echoed:
        delta["content"] = echoed + text
    logprobs = None
    if job.params.logprobs is not None:
        logprobs = chat_logprobs(sent, 0, job.top_logprobs)
    elif not delta and reason is None:
        return None  # text inside a tool call that is not an argument fragment yet
    return {
        "index": choice.index,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": reason,
        "stop_reason": out.stop_reason if reason else None,
    }
