"""OpenAI-compatible request bodies as msgspec Structs: decoding validates types, and
/openapi.json is generated from these same definitions."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from cpud.sampling_params import (
    LOGIT_BIAS_LIMIT,
    MAX_COUNT,
    MAX_LOGIT_BIAS,
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
MAX_TOOLS = 128
MAX_SALT_CHARS = 4096

Temperature = Annotated[float, Meta(ge=0.0, le=2.0, description="0 means greedy")]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Count = Annotated[int, Meta(ge=1, le=MAX_COUNT)]
Logprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
Name = Annotated[str, Meta(max_length=MAX_NAME_CHARS)]
StopString = Annotated[str, Meta(max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)] | None
Bias = Annotated[float, Meta(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]
TokenId = Annotated[int, Meta(ge=0, lt=TOKEN_ID_LIMIT)]
TokenIds = Annotated[list[TokenId], Meta(max_length=MAX_TOKEN_LIST)]
CacheSalt = Annotated[
    str,
    Meta(
        min_length=1,
        max_length=MAX_SALT_CHARS,
        description="vLLM: prefix-cache blocks are shared only among requests of one salt",
    ),
]


class Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A field cpud does not implement is a 400 naming it, never silently dropped."""


class StreamOptions(Strict, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: Annotated[
        bool, Meta(description="vLLM: usage on every chunk (with include_usage)")
    ] = False


class JsonSchemaFormat(Strict, kw_only=True):
    name: Name = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Strict, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Strict, kw_only=True):
    """vLLM's structured_outputs: exactly one of these."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: Annotated[list[str], Meta(min_length=1)] | None = None
    grammar: str | None = None


class SamplingFields(Strict, kw_only=True):
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
    logit_bias: (
        Annotated[
            dict[Annotated[str, Meta(max_length=20)], Bias],
            Meta(
                max_length=MAX_LOGIT_BIAS,
                description="token id (as a string) -> bias added to its logit, -100 to 100",
            ),
        ]
        | None
    ) = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Meta(min_length=1)] | None = None
    guided_grammar: str | None = None
    cache_salt: CacheSalt | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | Annotated[list[str | TokenId | TokenIds], Meta(max_length=MAX_TOKEN_LIST)]
    max_tokens: Annotated[int, Meta(ge=0, le=MAX_COUNT, description="0 only with echo")] | None = 16
    logprobs: Logprobs | None = None
    echo: bool = False


class TextPart(Strict, kw_only=True):
    type: Name
    text: str | None = None


class FunctionCall(Strict, kw_only=True):
    name: Name
    arguments: Annotated[str, Meta(description="the arguments: a JSON object in a string")]


class ToolCall(Strict, kw_only=True):
    id: Name
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(Strict, kw_only=True):
    role: Name
    content: str | list[TextPart] | None = None
    name: Name | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Name | None = None


class FunctionDef(Strict, kw_only=True):
    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict, kw_only=True):
    type: Literal["function"]
    function: FunctionDef


class ToolChoiceFunction(Strict, kw_only=True):
    name: Name


class NamedToolChoice(Strict, kw_only=True):
    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[Tool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    store: Annotated[bool, Meta(description="false only: cpud stores nothing")] | None = None


class TokenizeRequest(Strict, kw_only=True):
    model: Name | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(Strict, kw_only=True):
    model: Name | None = None
    tokens: TokenIds


class ResponsesTool(Strict, kw_only=True):
    type: Literal["function"]
    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesToolChoice(Strict, kw_only=True):
    type: Literal["function"]
    name: Name


class TextFormat(Strict, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: Name = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(Strict, kw_only=True):
    format: TextFormat | None = None


class ResponsesRequest(Strict, kw_only=True):
    """/v1/responses, stateless: input items are message, function_call and
    function_call_output objects."""

    model: Name | None = None
    input: str | Annotated[list[dict[str, Any]], Meta(min_length=1)]
    instructions: str | None = None
    tools: Annotated[list[ResponsesTool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: Count | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool = False
    store: Annotated[bool, Meta(description="false only: cpud stores nothing")] | None = None
    previous_response_id: Annotated[str, Meta(description="not supported (stateless)")] | None = (
        None
    )
    user: Name | None = None
    include: (
        Annotated[list[Name], Meta(max_length=0, description="no extra output data: empty")] | None
    ) = None
    cache_salt: CacheSalt | None = None


REQUEST_TYPES = {
    "CompletionRequest": CompletionRequest,
    "ChatCompletionRequest": ChatCompletionRequest,
    "TokenizeRequest": TokenizeRequest,
    "DetokenizeRequest": DetokenizeRequest,
    "ResponsesRequest": ResponsesRequest,
}
