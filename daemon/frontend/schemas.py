"""OpenAI-compatible request bodies as msgspec Structs: decoding validates types, and
/openapi.json is generated from these same definitions."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from cpud.sampling_params import (
    MAX_COUNT,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SEED_MAX,
    SEED_MIN,
    TOKEN_ID_LIMIT,
)

# Every number a request carries is bounded here, so an out-of-range one is a 400 naming it.
MAX_TOKEN_LIST = 1 << 20  # token ids in one prompt list: beyond any model's context
MAX_NAME_CHARS = 1024  # model names, roles, user tags

Temperature = Annotated[float, Meta(ge=0.0, le=2.0, description="0 means greedy")]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Count = Annotated[int, Meta(ge=1, le=MAX_COUNT)]
Logprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
Name = Annotated[str, Meta(max_length=MAX_NAME_CHARS)]
StopString = Annotated[str, Meta(max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)] | None
TokenId = Annotated[int, Meta(ge=0, lt=TOKEN_ID_LIMIT)]
TokenIds = Annotated[list[TokenId], Meta(max_length=MAX_TOKEN_LIST)]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by completions and chat completions (OpenAI's plus vLLM's extras)."""

    model: Name | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=-1, le=MAX_COUNT)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] | None = None
    seed: Annotated[int, Meta(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: Stop = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Meta(ge=0, le=MAX_COUNT)] = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: (
        Annotated[int, Meta(ge=0, le=MAX_LOGPROBS, description="top alternatives per prompt token")]
        | None
    ) = None
    user: Name | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | Annotated[list[str | TokenId | TokenIds], Meta(max_length=MAX_TOKEN_LIST)]
    max_tokens: Annotated[int, Meta(ge=0, le=MAX_COUNT, description="0 only with echo")] | None = 16
    logprobs: Logprobs | None = None
    echo: bool = False


class TextPart(msgspec.Struct):
    type: Name
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: Name
    content: str | list[TextPart] | None = None
    name: Name | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: Name | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: Name | None = None
    tokens: TokenIds


REQUEST_TYPES = {
    "CompletionRequest": CompletionRequest,
    "ChatCompletionRequest": ChatCompletionRequest,
    "TokenizeRequest": TokenizeRequest,
    "DetokenizeRequest": DetokenizeRequest,
}
