"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) on the chat path: the
request becomes a chat completion job (system and text blocks as messages, tool_use blocks as
the assistant's tool calls, tool_result blocks as tool messages, tools and tool_choice as
function tools), and its output is answered as a Message or streamed as Anthropic's events.
A final assistant message is a prefill: the answer continues its text."""

from __future__ import annotations

import json
from dataclasses import replace

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from cpud.frontend.access_log import access_note
from cpud.frontend.anthropic_answer import (
    answer_blocks,
    message_json,
    new_message_id,
    stop_reason,
    usage_json,
)
from cpud.frontend.anthropic_schemas import (
    AnthropicToolChoice,
    AnyChoice,
    AutoChoice,
    Block,
    CountTokensRequest,
    MessagesFields,
    MessagesRequest,
    NamedChoice,
    NoneChoice,
    RedactedThinkingBlock,
    Refused,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from cpud.frontend.anthropic_stream import MessageStream
from cpud.frontend.errors import bad_request
from cpud.frontend.jobs import Job, chat_job
from cpud.frontend.openai_api import collect_or_abort, start_requests
from cpud.frontend.requests import Prompt, check_text_size
from cpud.frontend.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDef,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    TextPart,
    Tool,
    ToolCall,
    ToolChoice,
    ToolChoiceFunction,
)
from cpud.frontend.state import ServerState

NULL_ONLY = ("mcp_servers", "context_management", "container")
REFUSED_WHY = {
    "image": "cpud serves text models",
    "document": "cpud serves text models",
    "search_result": "cpud serves text only",
    "thinking": "thinking blocks belong in assistant messages",
    "redacted_thinking": "thinking blocks belong in assistant messages",
}


def _refuse(block: Refused, where: str) -> None:
    kind = type(block).__struct_config__.tag
    raise bad_request(
        f"{where}: {kind} blocks are not supported ({REFUSED_WHY[kind]}); send text blocks",
        where,
    )


def _text_parts(blocks: list, where: str) -> list[TextPart]:
    parts = []
    for k, block in enumerate(blocks):
        if isinstance(block, Refused):
            _refuse(block, f"{where}[{k}]")
        parts.append(TextPart(type="text", text=block.text))
    return parts


def _tool_message(block: ToolResultBlock, where: str) -> ChatMessage:
    content: str | list[TextPart] = ""
    if isinstance(block.content, str):
        content = block.content
    elif block.content is not None:
        content = _text_parts(block.content, f"{where}.content")
    if block.is_error:
        texts = [content] if isinstance(content, str) else [p.text or "" for p in content]
        content = "Error: " + "\n".join(texts)
    return ChatMessage(role="tool", content=content, tool_call_id=block.tool_use_id)


def _user_messages(blocks: list[Block | Refused], where: str) -> list[ChatMessage]:
    """Text blocks as user messages, each tool_result as a tool message, in their order."""
    messages: list[ChatMessage] = []
    parts: list[TextPart] = []
    for k, block in enumerate(blocks):
        at = f"{where}.content[{k}]"
        if isinstance(block, TextBlock):
            parts.append(TextPart(type="text", text=block.text))
        elif isinstance(block, ToolResultBlock):
            if parts:
                messages.append(ChatMessage(role="user", content=parts))
                parts = []
            messages.append(_tool_message(block, at))
        elif isinstance(block, Refused):
            _refuse(block, at)
        else:
            raise bad_request(f"{at}: tool_use blocks belong in assistant messages", at)
    if parts or not messages:
        messages.append(ChatMessage(role="user", content=parts))
    return messages


def _assistant_message(blocks: list[Block | Refused], where: str) -> ChatMessage:
    parts: list[TextPart] = []
    calls: list[ToolCall] = []
    for k, block in enumerate(blocks):
        at = f"{where}.content[{k}]"
        if isinstance(block, TextBlock):
            parts.append(TextPart(type="text", text=block.text))
        elif isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            function = FunctionCall(name=block.name, arguments=arguments)
            calls.append(ToolCall(id=block.id, function=function))
        elif isinstance(block, (ThinkingBlock, RedactedThinkingBlock)):
            continue  # earlier reasoning, sent back as the answer gave it: not replayed
        elif isinstance(block, Refused):
            _refuse(block, at)
        else:
            raise bad_request(f"{at}: tool_result blocks belong in user messages", at)
    return ChatMessage(role="assistant", content=parts, tool_calls=calls or None)


def chat_messages(body: MessagesFields) -> tuple[list[ChatMessage], str]:
    """(the conversation as chat messages, the text of a final assistant message that the
    answer continues)."""
    messages = []
    if isinstance(body.system, str) and body.system:
        messages.append(ChatMessage(role="system", content=body.system))
    elif isinstance(body.system, list) and body.system:
        messages.append(ChatMessage(role="system", content=_text_parts(body.system, "system")))
    for index, message in enumerate(body.messages):
        where = f"messages[{index}]"
        content = message.content
        blocks = [TextBlock(text=content)] if isinstance(content, str) else content
        if message.role == "assistant":
            messages.append(_assistant_message(blocks, where))
        else:
            messages += _user_messages(blocks, where)
    prefill = ""
    if body.messages[-1].role == "assistant":
        last = messages.pop()
        where = f"messages[{len(body.messages) - 1}]"
        if last.tool_calls:
            raise bad_request(
                f"{where}: the conversation ends with a tool_use; send its tool_result in a "
                "user message after it",
                where,
            )
        prefill = "".join(part.text or "" for part in last.content or ())
    if not any(m.role != "system" for m in messages):
        raise bad_request("messages needs a user message before the answer", "messages")
    return messages, prefill


def chat_tools(body: MessagesFields) -> list[Tool] | None:
    tools = []
    for index, tool in enumerate(body.tools or ()):
        where = f"tools[{index}]"
        if tool.type not in (None, "custom"):
            raise bad_request(
                f"{where}: the server tool {tool.type!r} is not supported by cpud; give client "
                "tools (name, description, input_schema)",
                f"{where}.type",
            )
        if tool.input_schema is None:
            raise bad_request(f"{where}.input_schema is required", f"{where}.input_schema")
        function = FunctionDef(
            name=tool.name, description=tool.description, parameters=tool.input_schema
        )
        tools.append(Tool(type="function", function=function))
    return tools or None


def chat_tool_choice(choice: AnthropicToolChoice | None) -> tuple[ToolChoice | None, bool]:
    """(the chat tool_choice, whether several calls may come in one answer)."""
    if choice is None:
        return None, True
    parallel = isinstance(choice, NoneChoice) or not choice.disable_parallel_tool_use
    if isinstance(choice, AutoChoice):
        return "auto", parallel
    if isinstance(choice, AnyChoice):
        return "required", parallel
    if isinstance(choice, NamedChoice):
        named = NamedToolChoice(type="function", function=ToolChoiceFunction(name=choice.name))
        return named, parallel
    return "none", parallel


def check_supported(body: MessagesFields | MessagesRequest) -> None:
    """Fields cpud cannot honour are refused unless null (or, for thinking, disabled)."""
    for name in NULL_ONLY:
        if getattr(body, name, None) is not None:
            raise bad_request(f"{name} is not supported by cpud; remove it", name)
    thinking_kwargs(body.thinking)
    stops = getattr(body, "stop_sequences", None) or ()
    if any(not stop for stop in stops):
        raise bad_request("stop_sequences must not hold empty strings", "stop_sequences")


def thinking_kwargs(thinking: dict | None) -> dict | None:
    """The chat template's kwargs for `thinking`: disabled turns a think-block template's
    reasoning off (enable_thinking false); enabled and adaptive leave the template as it is
    (enabled's budget_tokens caps the reasoning: thinking_budget)."""
    kind = None if thinking is None else thinking.get("type")
    if kind not in (None, "disabled", "enabled", "adaptive"):
        raise bad_request(
            'thinking.type must be "enabled", "adaptive" or "disabled"', "thinking.type"
        )
    budget = (thinking or {}).get("budget_tokens")
    if kind == "enabled" and (
        not isinstance(budget, int) or isinstance(budget, bool) or budget < 1
    ):
        raise bad_request(
            "thinking.budget_tokens must be a positive integer", "thinking.budget_tokens"
        )
    return {"enable_thinking": False} if kind == "disabled" else None


def thinking_budget(thinking: dict | None) -> int | None:
    """The reasoning's cap: budget_tokens of `thinking` enabled (checked by thinking_kwargs);
    0 for disabled (a format the template cannot turn off, harmony, closes its analysis at
    once), else None."""
    kind = None if thinking is None else thinking.get("type")
    if kind == "disabled":
        return 0
    return thinking["budget_tokens"] if kind == "enabled" else None


def output_format(body: MessagesRequest) -> ResponseFormat | None:
    """output_config.format as the chat path's response_format (the answer's text is JSON of
    that schema)."""
    config = body.output_config
    if config is None:
        return None
    if config.effort is not None:
        raise bad_request(
            "output_config.effort is not supported by cpud; leave it out", "output_config.effort"
        )
    if config.format is None:
        return None
    schema = JsonSchemaFormat(name="response", schema=config.format.schema)
    return ResponseFormat(type="json_schema", json_schema=schema)


def chat_request(body: MessagesFields | MessagesRequest) -> tuple[ChatCompletionRequest, str]:
    """The chat completion request of a Messages body, and its prefill text."""
    check_supported(body)
    messages, prefill = chat_messages(body)
    choice, parallel = chat_tool_choice(body.tool_choice)
    chat = ChatCompletionRequest(
        model=body.model,
        messages=messages,
        tools=chat_tools(body),
        tool_choice=choice,
        parallel_tool_calls=parallel,
        chat_template_kwargs=thinking_kwargs(body.thinking),
        thinking_token_budget=thinking_budget(body.thinking),
    )
    if isinstance(body, MessagesRequest):
        sampling = {
            "response_format": output_format(body),
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "user": body.metadata.user_id if body.metadata is not None else None,
        }
        chat = msgspec.structs.replace(
            chat,
            max_tokens=body.max_tokens,
            stop=list(body.stop_sequences) if body.stop_sequences else None,
            stream=bool(body.stream),
            **{k: v for k, v in sampling.items() if v is not None},
        )
    return chat, prefill


def message_job(state: ServerState, body: MessagesFields | MessagesRequest) -> Job:
    chat, prefill = chat_request(body)
    job = replace(chat_job(state, chat), request_id=new_message_id())
    if not prefill:
        return job
    text = (job.prompts[0].text or "") + prefill
    check_text_size(state, len(text), "messages")
    prompt = Prompt(state.tokenizer.encode(text, add_special_tokens=False), text)
    return replace(job, prompts=[prompt])


def counted_tokens(state: ServerState, body: CountTokensRequest) -> dict:
    return {"input_tokens": len(message_job(state, body).prompts[0].token_ids)}


async def respond_messages(state: ServerState, request: Request, body: MessagesRequest) -> Response:
    job = await state.off_loop(message_job, state, body)
    streams = await start_requests(
        state, job.request_id, job.prompts, job.params, request, job.reasoning_budget
    )
    note = access_note(request)
    note.request_id, note.model = job.request_id, job.model
    note.prompt_tokens = len(job.prompts[0].token_ids)
    details = state.config.prompt_tokens_details
    if job.stream:
        return StreamingResponse(
            MessageStream(job, note, details).events(streams[0]),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    final = (await collect_or_abort(request, streams))[0]
    out = final.outputs[0]
    note.completion_tokens = len(out.token_ids)
    cut = out.finish_reason == "length"
    blocks, called = answer_blocks(
        out.text, job.reasoning, job.tool_parser, job.parallel_tool_calls, cut
    )
    cached = final.num_cached_tokens if details else 0
    usage = usage_json(len(final.prompt_token_ids), cached, len(out.token_ids))
    answer = message_json(job.request_id, job.model, blocks, stop_reason(out, called), usage)
    return JSONResponse(answer)
