"""/v1/responses with include ["message.output_text.logprobs"]: the output text's token
logprobs (top_logprobs alternatives each) on its output_text part and on each streamed
delta, in the shape of chat's logprobs.content."""

from __future__ import annotations

from cpud.engine.outputs import CompletionOutput
from cpud.frontend.errors import bad_request
from cpud.frontend.logprobs import chat_logprobs
from cpud.frontend.schemas import ResponsesRequest

LOGPROBS = "message.output_text.logprobs"


def wanted(body: ResponsesRequest) -> bool:
    return LOGPROBS in (body.include or ())


def chat_fields(body: ResponsesRequest) -> dict:
    """The chat request's logprobs fields for this body."""
    if not wanted(body):
        return {}
    if body.tools:
        raise bad_request(
            f"include {LOGPROBS} is not available with tools: leave one out", param="include"
        )
    return {"logprobs": True, "top_logprobs": body.top_logprobs or 0}


def token_logprobs(out: CompletionOutput, start: int, top: int) -> list[dict]:
    """The logprobs of the output's tokens from `start` on."""
    return chat_logprobs(out, start, top)["content"]


def with_logprobs(item: dict, logprobs: list[dict]) -> dict:
    """A message item whose output_text part carries `logprobs`."""
    for part in item["content"]:
        part["logprobs"] = logprobs
    return item
