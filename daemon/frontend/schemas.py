"""OpenAI-compatible request bodies as msgspec Structs: decoding validates types, and
/openapi.json is generated from these same definitions.

A JSON null is the field left out, in every request type: SDKs send null for every argument
their user passed as None. Fields cpud does not implement are declared so that null, or the
value that asks for what cpud does anyway, is accepted; any other value is a 400 naming it
(the `unsupported` table of each type)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta

from cpud.engine.sampling_params import (
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


@dataclass(frozen=True)
class Unsupported:
    """A field cpud accepts only with values that change nothing: `accepts(value)` says
    which, `hint` tells the client what to send instead."""

    accepts: Callable[[Any], bool]
    hint: str


def only(*values: Any) -> Callable[[Any], bool]:
    return lambda value: value in values


NOT_SUPPORTED = Unsupported(only(), "cpud does not implement it; leave it out or send null")


class Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A field cpud does not know is a 400 naming it, never silently dropped. A null field
    takes its default (`null_kept` lists the fields where null has a meaning of its own)."""

    unsupported: ClassVar[Mapping[str, Unsupported]] = {}
    null_kept: ClassVar[frozenset[str]] = frozenset()

    def __post_init__(self) -> None:
        for name, default in _null_defaults(type(self)):
            if getattr(self, name) is None:
                setattr(self, name, default)


@cache
def _null_defaults(cls: type[Strict]) -> tuple[tuple[str, Any], ...]:
    """(field, default) of the fields whose default is not None: a null sent for one of them
    is replaced by the default."""
    return tuple(
        (f.name, f.default)
        for f in msgspec.structs.fields(cls)
        if f.default is not None
        and f.default is not msgspec.NODEFAULT
        and f.name not in cls.null_kept
    )


class StreamOptions(Strict, kw_only=True):
    include_usage: bool | None = False
    continuous_usage_stats: (
        Annotated[bool, Meta(description="vLLM: usage on every chunk (with include_usage)")] | None
    ) = False


class JsonSchemaFormat(Strict, kw_only=True):
    name: Name | None = "response"
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


NO_HIDDEN_STATES = Unsupported(only(False), "cpud returns no hidden states: send false or null")


class SamplingFields(Strict, kw_only=True):
    """Fields shared by completions and chat completions (OpenAI's plus vLLM's extras, and
    the SGLang-named ones vllm-router forwards)."""

    unsupported: ClassVar[Mapping[str, Unsupported]] = {
        "return_hidden_states": NO_HIDDEN_STATES,
        "priority": Unsupported(only(0), "cpud serves first come, first served: send 0 or null"),
        "use_beam_search": Unsupported(only(False), "cpud does no beam search: send false"),
        "length_penalty": Unsupported(only(1.0), "cpud does no beam search: send 1.0 or null"),
        "kv_transfer_params": NOT_SUPPORTED,
    }

    model: Name | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] | None = 1
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
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    min_tokens: Annotated[int, Meta(ge=0, le=MAX_COUNT)] | None = 0
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
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
    no_stop_trim: (
        Annotated[
            bool,
            Meta(description="vllm-router: true keeps a matched stop string in the output"),
        ]
        | None
    ) = False
    return_hidden_states: (
        Annotated[bool, Meta(description="vllm-router: false only (no hidden states)")] | None
    ) = False
    truncate_prompt_tokens: (
        Annotated[
            int,
            Meta(
                ge=-1,
                le=MAX_COUNT,
                description="vLLM: keep the prompt's last k tokens (-1: the context's length)",
            ),
        ]
        | None
    ) = None
    spaces_between_special_tokens: (
        Annotated[bool, Meta(description="vLLM: no effect with fast tokenizers (cpud's)")] | None
    ) = True
    priority: Annotated[int, Meta(ge=-(2**31), lt=2**31, description="vLLM: 0 only")] | None = 0
    use_beam_search: Annotated[bool, Meta(description="vLLM: false only")] | None = False
    length_penalty: (
        Annotated[float, Meta(ge=-100.0, le=100.0, description="vLLM: 1.0 only")] | None
    ) = 1.0
    kv_transfer_params: (
        Annotated[dict[str, Any], Meta(description="vLLM: not supported, null only")] | None
    ) = None


class CompletionRequest(SamplingFields, kw_only=True):
    # As vLLM: max_tokens null generates up to the context, left out it is 16.
    null_kept: ClassVar[frozenset[str]] = frozenset({"max_tokens"})

    prompt: str | Annotated[list[str | TokenId | TokenIds], Meta(max_length=MAX_TOKEN_LIST)]
    max_tokens: (
        Annotated[
            int, Meta(ge=0, le=MAX_COUNT, description="0 only with echo; null: up to the context")
        ]
        | None
    ) = 16
    logprobs: Logprobs | None = None
    echo: bool | None = False


class TextPart(Strict, kw_only=True):
    type: Name
    text: str | None = None


class FunctionCall(Strict, kw_only=True):
    name: Name
    arguments: Annotated[str, Meta(description="the arguments: a JSON object in a string")]


class ToolCall(Strict, kw_only=True):
    id: Name
    function: FunctionCall
    type: Literal["function"] | None = "function"


class ChatMessage(Strict, kw_only=True):
    role: Name
    content: str | list[TextPart] | None = None
    name: Name | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Name | None = None
    # An earlier answer's reasoning, as cpud (and vLLM) gave it: the template may replay it.
    reasoning_content: str | None = None
    reasoning: str | None = None


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


ONE_TIER = Unsupported(only("auto", "default"), "cpud has one service tier: send auto or null")
TEXT_ONLY = Unsupported(only(["text"]), 'cpud answers in text only: send ["text"] or null')
Metadata = Annotated[dict[str, Any], Meta(description="accepted and ignored")]
Ignored = Annotated[str, Meta(max_length=MAX_NAME_CHARS, description="accepted and ignored")]


EFFORTS = ("low", "medium", "high")
EFFORT = Unsupported(
    only(*EFFORTS), "send low, medium or high (the chat template reads it as reasoning_effort)"
)


class ChatCompletionRequest(SamplingFields, kw_only=True):
    unsupported: ClassVar[Mapping[str, Unsupported]] = {
        **SamplingFields.unsupported,
        "service_tier": ONE_TIER,
        "modalities": TEXT_ONLY,
        "audio": NOT_SUPPORTED,
        "prediction": NOT_SUPPORTED,
        "reasoning_effort": EFFORT,
        "web_search_options": NOT_SUPPORTED,
    }

    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool | None = False
    top_logprobs: Logprobs | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: (
        Annotated[
            bool,
            Meta(
                description="vLLM: the final message stays open for the model to continue "
                "(with add_generation_prompt false)"
            ),
        ]
        | None
    ) = False
    echo: (
        Annotated[
            bool,
            Meta(
                description="vLLM: the answer starts with the final message when it is the "
                "assistant's"
            ),
        ]
        | None
    ) = False
    add_special_tokens: (
        Annotated[bool, Meta(description="vLLM: also the tokenizer's BOS etc. around the prompt")]
        | None
    ) = False
    separate_reasoning: (
        Annotated[bool, Meta(description="false: the reasoning stays in the content")] | None
    ) = None
    stream_reasoning: (
        Annotated[
            bool, Meta(description="SGLang: false streams the reasoning in one piece when it ends")
        ]
        | None
    ) = None
    thinking_token_budget: (
        Annotated[
            int,
            Meta(
                ge=0,
                le=MAX_COUNT,
                description="vLLM: reasoning tokens after which the reasoning is closed",
            ),
        ]
        | None
    ) = None
    include_reasoning: (
        Annotated[bool, Meta(description="vLLM: false leaves the reasoning out")] | None
    ) = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[Tool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = True
    store: Annotated[bool, Meta(description="false only: cpud stores nothing")] | None = None
    metadata: Metadata | None = None
    prompt_cache_key: Ignored | None = None
    safety_identifier: Ignored | None = None
    service_tier: Annotated[str, Meta(description="auto or default only")] | None = None
    modalities: Annotated[list[Name], Meta(description='["text"] only')] | None = None
    audio: Annotated[dict[str, Any], Meta(description="not supported: null only")] | None = None
    prediction: Annotated[dict[str, Any], Meta(description="not supported: null only")] | None = (
        None
    )
    reasoning_effort: (
        Annotated[str, Meta(description="low, medium or high: the template's reasoning_effort")]
        | None
    ) = None
    web_search_options: (
        Annotated[dict[str, Any], Meta(description="not supported: null only")] | None
    ) = None


class TokenizeRequest(Strict, kw_only=True):
    model: Name | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = True
    add_generation_prompt: (
        Annotated[bool, Meta(description="messages only: end with the assistant's turn opening")]
        | None
    ) = True
    continue_final_message: (
        Annotated[bool, Meta(description="messages only: leave the final message open")] | None
    ) = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: (
        Annotated[bool, Meta(description="vLLM: also each token as its vocabulary string")] | None
    ) = False


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
    name: Name | None = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(Strict, kw_only=True):
    format: TextFormat | None = None


class ResponsesReasoning(Strict, kw_only=True):
    """effort reaches the chat template as reasoning_effort; cpud writes no summaries."""

    unsupported: ClassVar[Mapping[str, Unsupported]] = {
        "effort": EFFORT,
        "summary": NOT_SUPPORTED,
        "generate_summary": NOT_SUPPORTED,
    }

    effort: Name | None = None
    summary: Name | None = None
    generate_summary: Name | None = None


# include values cpud honours: the output text's logprobs, and encrypted reasoning, which
# adds nothing (reasoning items carry their text; cpud encrypts none).
INCLUDES = frozenset({"message.output_text.logprobs", "reasoning.encrypted_content"})


class ResponsesRequest(Strict, kw_only=True):
    """/v1/responses, stateless: input items are message, function_call and
    function_call_output objects."""

    unsupported: ClassVar[Mapping[str, Unsupported]] = {
        "include": Unsupported(
            lambda values: set(values) <= INCLUDES,
            "cpud can include message.output_text.logprobs and reasoning.encrypted_content "
            "(cpud encrypts no reasoning: it adds nothing); leave the others out",
        ),
        "truncation": Unsupported(
            only("disabled"),
            "cpud never drops input items (an input too long for the context is a 400): send "
            '"disabled" or null',
        ),
        "service_tier": ONE_TIER,
        "background": Unsupported(only(False), "cpud answers in the foreground: send false"),
        "max_tool_calls": NOT_SUPPORTED,
        "prompt": NOT_SUPPORTED,
        "conversation": NOT_SUPPORTED,
    }

    model: Name | None = None
    input: str | Annotated[list[dict[str, Any]], Meta(min_length=1)]
    instructions: str | None = None
    tools: Annotated[list[ResponsesTool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = True
    text: TextConfig | None = None
    max_output_tokens: Count | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool | None = False
    store: Annotated[bool, Meta(description="false only: cpud stores nothing")] | None = None
    previous_response_id: Annotated[str, Meta(description="not supported (stateless)")] | None = (
        None
    )
    user: Name | None = None
    include: (
        Annotated[
            list[Name],
            Meta(
                max_length=64,
                description="message.output_text.logprobs, reasoning.encrypted_content",
            ),
        ]
        | None
    ) = None
    cache_salt: CacheSalt | None = None
    metadata: Metadata | None = None
    prompt_cache_key: Ignored | None = None
    safety_identifier: Ignored | None = None
    reasoning: ResponsesReasoning | None = None
    truncation: Annotated[str, Meta(description="disabled only")] | None = None
    service_tier: Annotated[str, Meta(description="auto or default only")] | None = None
    background: Annotated[bool, Meta(description="false only")] | None = None
    top_logprobs: (
        Annotated[
            int,
            Meta(
                ge=0,
                le=MAX_LOGPROBS,
                description="alternatives per token, with include message.output_text.logprobs",
            ),
        ]
        | None
    ) = None
    max_tool_calls: (
        Annotated[int, Meta(ge=0, le=MAX_COUNT, description="not supported: null only")] | None
    ) = None
    prompt: Annotated[dict[str, Any], Meta(description="not supported: null only")] | None = None
    conversation: (
        Annotated[str | dict[str, Any], Meta(description="not supported: null only")] | None
    ) = None


class EmbeddingRequest(Strict, kw_only=True):
    """/v1/embeddings: each input (a string, a list of token ids, or a list of either) is one
    engine request; all of them run together."""

    model: Name | None = None
    input: str | Annotated[list[str | TokenId | TokenIds], Meta(max_length=MAX_TOKEN_LIST)]
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: (
        Annotated[
            int,
            Meta(
                ge=1, le=MAX_COUNT, description="the first values only (Matryoshka), renormalised"
            ),
        ]
        | None
    ) = None
    user: Name | None = None
    truncate_prompt_tokens: (
        Annotated[
            int,
            Meta(
                ge=-1,
                le=MAX_COUNT,
                description="vLLM: keep each input's last k tokens (-1: the context's length)",
            ),
        ]
        | None
    ) = None
    add_special_tokens: bool | None = True


REQUEST_TYPES = {
    "CompletionRequest": CompletionRequest,
    "ChatCompletionRequest": ChatCompletionRequest,
    "TokenizeRequest": TokenizeRequest,
    "DetokenizeRequest": DetokenizeRequest,
    "ResponsesRequest": ResponsesRequest,
    "EmbeddingRequest": EmbeddingRequest,
}
