"""The grammar of tool calls in a parser's format, alone (tool_choice forces a call) or beside
the answer another constraint asks for (tool_choice auto with response_format).

A call is fixed text up to its arguments (`{"name": "<function>", "arguments": `), so the
function is known from the first tokens and no token goes to whitespace; the arguments are
the function's parameters embedded as their own `%json` grammar, generated as response_format
JSON is (closed objects, fixed separators), so their `$defs` / `$ref` pointers resolve."""

from __future__ import annotations

import json

from cpud.structured.grammar import answer_lark, embedded_json
from cpud.structured.spec import StructuredSpec

ARGUMENTS_KEY = {"hermes": "arguments", "llama3_json": "parameters", "mistral": "arguments"}


def _nested_refs(schema: object, at: str) -> object:
    """A copy of `schema` whose local `$ref`s point where the schema sits (`at`) in a larger
    document."""
    if isinstance(schema, list):
        return [_nested_refs(item, at) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _nested_refs(value, at) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = "#" + at + ref[1:]
    return out


def _call_rules(tools: list[dict], args_key: str, bare: bool) -> list[str]:
    """`call` (any one of the functions) and a rule per function. A call is fixed text up to
    its arguments, which are their own `%json`; a bare call (llama3_json's, which starts as a
    JSON answer starts) is one `%json` whole, so beside a JSON answer the two merge into one
    JSON grammar instead of contending for the first `{`."""
    rules = ["call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
    for index, tool in enumerate(tools):
        fn = tool["function"]
        params = fn["parameters"]
        if "type" not in params:  # arguments are an object whatever else the schema says
            params = {**params, "type": "object"}
        if bare:
            whole = {
                "type": "object",
                "properties": {
                    "name": {"const": fn["name"]},
                    args_key: _nested_refs(params, f"/properties/{args_key}"),
                },
                "required": ["name", args_key],
            }
            rules.append(f"call_{index}: {embedded_json(whole)}")
            continue
        head = "{" + f'"name": {json.dumps(fn["name"], ensure_ascii=False)}, "{args_key}": '
        rules.append(f'call_{index}: {json.dumps(head)} args_{index} "}}"')
        rules.append(f"args_{index}: {embedded_json(params)}")
    return rules


def _calls_rule(parser: str, parallel: bool) -> str:
    """`calls`: one call, or one or more when parallel calls are allowed, in the parser's
    format."""
    if parser == "hermes":
        more = ' ("\\n" tagged)*' if parallel else ""
        return f'calls: tagged{more}\ntagged: "<tool_call>\\n" call "\\n</tool_call>"'
    if parser == "mistral":
        more = ' (", " call)*' if parallel else ""
        return f'calls: "[TOOL_CALLS][" call{more} "]"'
    more = ' ("; " call)*' if parallel else ""
    return f"calls: call{more}"


def call_grammar(
    tools: list[dict], parser: str, parallel: bool, answer: StructuredSpec | None = None
) -> StructuredSpec:
    """A Lark grammar (llguidance's dialect) whose sentences are tool calls in the parser's
    format, or, given `answer`, those and the answer's sentences. A Lark grammar of the
    client's own cannot be nested: with it the answer is the whole constraint."""
    start = "start: calls"
    source = "tools"
    if answer is not None:
        expression = answer_lark(answer)
        if expression is None:
            return answer
        start += " | answer\nanswer: " + expression
        source = answer.source
    rules = [
        start,
        _calls_rule(parser, parallel),
        *_call_rules(tools, ARGUMENTS_KEY[parser], parser == "llama3_json"),
    ]
    return StructuredSpec("grammar", "\n".join(rules) + "\n", source=source)
