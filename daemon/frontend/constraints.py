"""Output constraints a request asks for (response_format, vLLM's guided_* and
structured_outputs) as the engine takes them: one StructuredSpec at most."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.requests import Request

from cpud.frontend.errors import APIError, bad_request
from cpud.frontend.schemas import ResponseFormat, SamplingFields
from cpud.structured.compiler import GrammarBusyError
from cpud.structured.pool import compile_scope
from cpud.structured.spec import StructuredSpec

T = TypeVar("T")

JSON_OBJECT = '{"type": "object"}'


def schema_text(schema: Any, param: str) -> str:
    """A JSON schema (an object, or a string holding one) as compact JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise bad_request(f"{param}: the schema is not valid JSON: {exc}", param) from None
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{param}: a JSON schema must be an object", param)
    return json.dumps(schema, separators=(",", ":"))


def response_format_spec(fmt: ResponseFormat | None, param: str) -> StructuredSpec | None:
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise bad_request(f"{param}: json_schema needs type json_schema", param)
        return None
    if fmt.type == "json_object":
        return StructuredSpec("json", JSON_OBJECT, source=param)
    if fmt.json_schema is None or fmt.json_schema.schema is None:
        raise bad_request(f"{param}: type json_schema needs json_schema.schema", param)
    return StructuredSpec("json", schema_text(fmt.json_schema.schema, param), source=param)


def requested_specs(body: SamplingFields) -> list[StructuredSpec]:
    """Every constraint the body names, whatever field it came by."""
    specs = []
    spec = response_format_spec(body.response_format, "response_format")
    if spec is not None:
        specs.append(spec)
    if body.guided_json is not None:
        specs.append(
            StructuredSpec("json", schema_text(body.guided_json, "guided_json"), (), "guided_json")
        )
    if body.guided_regex is not None:
        specs.append(StructuredSpec("regex", body.guided_regex, source="guided_regex"))
    if body.guided_choice is not None:
        specs.append(
            StructuredSpec("choice", choices=tuple(body.guided_choice), source="guided_choice")
        )
    if body.guided_grammar is not None:
        specs.append(StructuredSpec("grammar", body.guided_grammar, source="guided_grammar"))
    outputs = body.structured_outputs
    if outputs is not None:
        named = [
            (kind, value)
            for kind, value in (
                ("json", outputs.json),
                ("regex", outputs.regex),
                ("choice", outputs.choice),
                ("grammar", outputs.grammar),
            )
            if value is not None
        ]
        if len(named) != 1:
            raise bad_request(
                "structured_outputs: give exactly one of json, regex, choice, grammar",
                "structured_outputs",
            )
        kind, value = named[0]
        source = "structured_outputs"
        if kind == "json":
            specs.append(StructuredSpec("json", schema_text(value, source), source=source))
        elif kind == "choice":
            specs.append(StructuredSpec("choice", choices=tuple(value), source=source))
        else:
            specs.append(StructuredSpec(kind, value, source=source))
    return specs


def single_spec(specs: list[StructuredSpec]) -> StructuredSpec | None:
    """At most one constraint per request: two would conflict."""
    if len(specs) > 1:
        names = ", ".join(s.source for s in specs)
        raise bad_request(
            f"a request may constrain its output one way only, got {names}", specs[1].source
        )
    return specs[0] if specs else None


async def while_connected(request: Request | None, validation: Awaitable[T]) -> T:
    """Awaits the validation (where grammars compile) in its own compile scope: a client that
    disconnects meanwhile ends it (499) and cancels the compiles it queued, so a request
    nobody waits for is not compiled. Compile threads busy with others' grammars for all of
    the wait: 429."""
    with compile_scope():
        task = asyncio.ensure_future(validation)  # inherits the scope with the context
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    try:
                        return task.result()
                    except GrammarBusyError as exc:
                        raise APIError(
                            429,
                            str(exc),
                            "rate_limit_error",
                            None,
                            "grammar_busy",
                            {"Retry-After": "1"},
                        ) from None
                if request is not None and await request.is_disconnected():
                    raise APIError(499, "client disconnected", "client_closed_request")
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
