"""Anthropic Messages request bodies (/v1/messages, /v1/messages/count_tokens) as msgspec
Structs. Content blocks and tool_choice are unions tagged by `type`; block kinds cpud cannot
serve (images, documents, thinking) decode so that the answer can name them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from cpud.engine.sampling_params import MAX_COUNT, MAX_STOP_CHARS, MAX_STOP_STRINGS
from cpud.frontend.schemas import MAX_TOOLS, Count, Name, Strict, Temperature, TopP

ToolName = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
StopSequence = Annotated[str, Meta(max_length=MAX_STOP_CHARS)]


class CacheControl(Strict, kw_only=True):
    """Accepted and needs nothing: cpud's prefix cache reuses shared prompt prefixes anyway."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class Block(Strict, tag_field="type", kw_only=True):
    cache_control: CacheControl | None = None


class TextBlock(Block, tag="text", kw_only=True):
    text: str
    citations: Annotated[list[dict[str, Any]], Meta(max_length=0)] | None = None


class ToolUseBlock(Block, tag="tool_use", kw_only=True):
    id: Name
    name: ToolName
    input: dict[str, Any]


class Refused(msgspec.Struct, tag_field="type", kw_only=True):
    """A block kind cpud does not serve: decoded whatever it holds, then refused by name."""


class ImageBlock(Refused, tag="image", kw_only=True):
    pass


class DocumentBlock(Refused, tag="document", kw_only=True):
    pass


class SearchResultBlock(Refused, tag="search_result", kw_only=True):
    pass


class ThinkingBlock(Refused, tag="thinking", kw_only=True):
    pass


class RedactedThinkingBlock(Refused, tag="redacted_thinking", kw_only=True):
    pass


ResultPart = TextBlock | ImageBlock | DocumentBlock | SearchResultBlock


class ToolResultBlock(Block, tag="tool_result", kw_only=True):
    tool_use_id: Name
    content: str | list[ResultPart] | None = None
    is_error: bool | None = None


ContentBlock = (
    TextBlock
    | ToolUseBlock
    | ToolResultBlock
    | ImageBlock
    | DocumentBlock
    | SearchResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
)


class MessageParam(Strict, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(Strict, kw_only=True):
    """A client tool. Anthropic's server tools (a dated `type`) are refused by name."""

    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: Name | None = None
    cache_control: CacheControl | None = None


class ChoiceBase(Strict, tag_field="type", kw_only=True):
    pass


class AutoChoice(ChoiceBase, tag="auto", kw_only=True):
    disable_parallel_tool_use: bool | None = None


class AnyChoice(ChoiceBase, tag="any", kw_only=True):
    disable_parallel_tool_use: bool | None = None


class NamedChoice(ChoiceBase, tag="tool", kw_only=True):
    name: Name
    disable_parallel_tool_use: bool | None = None


class NoneChoice(ChoiceBase, tag="none", kw_only=True):
    pass


AnthropicToolChoice = AutoChoice | AnyChoice | NamedChoice | NoneChoice


class MessagesMetadata(Strict, kw_only=True):
    user_id: Name | None = None


class OutputFormat(Strict, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(Strict, kw_only=True):
    format: OutputFormat | None = None
    effort: Annotated[str, Meta(description="not supported: null only")] | None = None


class MessagesFields(Strict, kw_only=True):
    """What /v1/messages and /v1/messages/count_tokens share: the prompt."""

    model: Name | None = None
    messages: Annotated[list[MessageParam], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[AnthropicTool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: AnthropicToolChoice | None = None
    cache_control: CacheControl | None = None
    thinking: (
        Annotated[
            dict[str, Any],
            Meta(
                description="disabled turns a think-block template's reasoning off; enabled "
                "(budget_tokens not enforced) and adaptive leave it on"
            ),
        ]
        | None
    ) = None
    mcp_servers: Annotated[Any, Meta(description="not supported: null only")] = None
    context_management: Annotated[Any, Meta(description="not supported: null only")] = None


class MessagesRequest(MessagesFields, kw_only=True):
    max_tokens: Count
    stop_sequences: Annotated[list[StopSequence], Meta(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=0, le=MAX_COUNT, description="0 means off")] | None = None
    metadata: MessagesMetadata | None = None
    output_config: OutputConfig | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    container: Annotated[Any, Meta(description="not supported: null only")] = None


class CountTokensRequest(MessagesFields, kw_only=True):
    pass
