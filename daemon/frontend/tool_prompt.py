"""Tools in the prompt: the tools a request declares and may call, the messages a chat
template renders (assistant tool_calls, role "tool" results) and the Hermes system prompt for
templates that know no tools."""

from __future__ import annotations

import json
from typing import Any

import llguidance

from cpud.frontend.errors import bad_request
from cpud.frontend.schemas import ChatMessage, NamedToolChoice, Tool
from cpud.settings.errors import one_line

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def template_knows_tools(template: str | None) -> bool:
    """Whether a chat template renders the `tools` it is given (else cpud writes them into
    the system prompt)."""
    return template is not None and "tools" in template


def tool_dicts(tools: list[Tool]) -> list[dict]:
    """Tools as transformers' apply_chat_template takes them (OpenAI's JSON shape)."""
    result = []
    for index, tool in enumerate(tools):
        fn = tool.function
        params = fn.parameters if fn.parameters is not None else ANY_OBJECT
        if params.get("type", "object") != "object":
            raise bad_request(
                f"tools[{index}].function.parameters must be a JSON schema of type object",
                "tools",
            )
        problem = llguidance.LLMatcher.validate_grammar(
            llguidance.grammar_from("json_schema", json.dumps(params))
        )
        if problem:
            raise bad_request(
                f"tools[{index}].function.parameters is not a usable JSON schema: "
                f"{one_line(problem, 300)}",
                "tools",
            )
        entry: dict[str, Any] = {"name": fn.name, "parameters": params}
        if fn.description is not None:
            entry["description"] = fn.description
        result.append({"type": "function", "function": entry})
    names = [t["function"]["name"] for t in result]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise bad_request(f"tools: two functions are named {duplicate!r}", "tools")
    return result


def chosen_tools(
    tools: list[dict], choice: str | NamedToolChoice | None
) -> tuple[list[dict], bool]:
    """(the tools the model may call, whether it must call one) for a tool_choice."""
    if isinstance(choice, NamedToolChoice):
        named = [t for t in tools if t["function"]["name"] == choice.function.name]
        if not named:
            raise bad_request(
                f"tool_choice names {choice.function.name!r}, which is not in tools",
                "tool_choice",
            )
        return named, True
    return tools, choice == "required"


def hermes_system_prompt(tools: list[dict]) -> str:
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You can call functions. Their signatures are inside <tools></tools>:\n"
        f"<tools>\n{listing}\n</tools>\n"
        "To call a function, answer with a JSON object holding its name and arguments inside "
        "<tool_call></tool_call> tags, like this:\n"
        '<tool_call>\n{"name": "<function name>", "arguments": {<arguments>}}\n</tool_call>'
    )


def _content(message: ChatMessage, index: int) -> str | None:
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type not in ("text", "input_text", "output_text") or part.text is None:
                raise bad_request(
                    f"messages[{index}]: only text content parts are supported, got {part.type!r}",
                    "messages",
                )
            texts.append(part.text)
        return "\n".join(texts)  # as vLLM joins text parts
    return content


def _arguments_object(text: str, index: int) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise bad_request(
            f"messages[{index}].tool_calls: arguments must be a JSON object in a string",
            "messages",
        ) from None


def conversation(messages: list[ChatMessage], native_tools: bool) -> list[dict]:
    """Messages as the chat template sees them. A template that knows tools gets tool_calls
    (arguments as objects, as transformers expects) and tool messages as they are; for one
    that does not, calls and results are written into the text in the Hermes format."""
    result: list[dict] = []
    call_ids: set[str] = set()
    for index, message in enumerate(messages):
        content = _content(message, index)
        entry: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.name is not None:
            entry["name"] = message.name
        reasoning = message.reasoning_content or message.reasoning
        if reasoning and message.role == "assistant":
            entry["reasoning_content"] = reasoning  # as Qwen3's and gpt-oss's templates read it
        if message.tool_calls:
            if message.role != "assistant":
                raise bad_request(
                    f"messages[{index}]: only assistant messages carry tool_calls", "messages"
                )
            calls = []
            for call in message.tool_calls:
                call_ids.add(call.id)
                arguments = _arguments_object(call.function.arguments, index)
                calls.append(
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": arguments},
                    }
                )
            if native_tools:
                entry["tool_calls"] = calls
            else:
                written = "\n".join(
                    "<tool_call>\n"
                    + json.dumps(c["function"], ensure_ascii=False)
                    + "\n</tool_call>"
                    for c in calls
                )
                entry["content"] = (entry["content"] + "\n" + written).lstrip("\n")
        if message.role == "tool":
            if message.tool_call_id is None or message.tool_call_id not in call_ids:
                raise bad_request(
                    f"messages[{index}]: a tool message needs the tool_call_id of an earlier "
                    f"assistant tool call, got {message.tool_call_id!r}",
                    "messages",
                )
            if native_tools:
                entry["tool_call_id"] = message.tool_call_id
            else:
                entry["content"] = f"<tool_response>\n{entry['content']}\n</tool_response>"
        result.append(entry)
    return result


def with_system_prompt(messages: list[dict], prompt: str) -> list[dict]:
    """The Hermes tool prompt added to the system message (or as a new one first)."""
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=messages[0]["content"] + "\n\n" + prompt)
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
