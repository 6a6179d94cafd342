"""The shapes of Anthropic's Messages answers: the Message object, its content blocks, usage,
stop reasons and errors ({"type": "error", "error": {"type", "message"}})."""

from __future__ import annotations

import json
import uuid

from starlette.responses import JSONResponse, Response

from cpud.engine.outputs import CompletionOutput
from cpud.frontend.errors import APIError
from cpud.frontend.reasoning import ReasoningPlan
from cpud.frontend.reasoning_stream import read_all
from cpud.frontend.tool_calls import parse

MESSAGES_PATH = "/v1/messages"
ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_path(path: str) -> bool:
    """Whether a request path belongs to the Messages API (its errors take Anthropic's shape)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_type(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_json(error: APIError) -> dict:
    return {"type": "error", "error": {"type": error_type(error.status), "message": error.message}}


def error_response(path: str, error: APIError) -> Response:
    """The error answer for a request on `path`: Anthropic's shape on the Messages API,
    OpenAI's elsewhere."""
    if not anthropic_path(path):
        return error.response()
    return JSONResponse(error_json(error), status_code=error.status, headers=error.headers)


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def text_block(text: str) -> dict:
    return {"type": "text", "text": text}


def thinking_block(text: str) -> dict:
    """The model's reasoning; cpud signs nothing (the signature is empty)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def tool_use_block(name: str, arguments: dict) -> dict:
    return {"type": "tool_use", "id": new_tool_use_id(), "name": name, "input": arguments}


def usage_json(prompt_tokens: int, cached: int, output_tokens: int) -> dict:
    """Anthropic counts the prompt tokens read from the cache apart from input_tokens."""
    return {
        "input_tokens": prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output_tokens,
    }


def stop_reason(out: CompletionOutput, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished output; `called`: it holds tool calls."""
    if out.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(out.stop_reason, str):
        return "stop_sequence", out.stop_reason
    return "end_turn", None


def _arguments(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def content_blocks(text: str, parser: str | None, parallel: bool) -> tuple[list[dict], bool]:
    """(content blocks, whether they hold tool_use) of a finished output. Calls whose
    arguments are not a JSON object leave the whole output as text."""
    if parser is not None:
        parsed = parse(text, parser, parallel)
        inputs = [_arguments(call.arguments) for call in parsed.calls]
        if parsed.calls and all(i is not None for i in inputs):
            blocks = [text_block(parsed.content)] if parsed.content else []
            blocks += [tool_use_block(c.name, i) for c, i in zip(parsed.calls, inputs)]
            return blocks, True
    return ([text_block(text)] if text else []), False


def answer_blocks(
    text: str, plan: ReasoningPlan | None, parser: str | None, parallel: bool, cut: bool
) -> tuple[list[dict], bool]:
    """(content blocks, whether they hold tool_use) of a finished output: its reasoning as
    a thinking block first, then the answer's blocks, then the format's own calls (harmony;
    one whose arguments are not a JSON object comes with an empty input)."""
    read = read_all(plan, text, cut)
    blocks = [thinking_block(read.reasoning)] if read.reasoning else []
    answer, called = content_blocks(read.content or "", parser, parallel)
    blocks += answer
    for call in read.calls:
        blocks.append(tool_use_block(call.name, _arguments(call.arguments) or {}))
    return blocks, called or bool(read.calls)


def message_json(
    message_id: str,
    model: str,
    content: list[dict],
    stop: tuple[str | None, str | None],
    usage: dict,
) -> dict:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": usage,
    }
