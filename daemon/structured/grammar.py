"""A StructuredSpec as llguidance grammar text (not yet checked: compiling does that)."""

from __future__ import annotations

import json

import llguidance

from cpud.settings.errors import RequestError
from cpud.structured.spec import StructuredSpec

# JSON is generated without free whitespace: a small model left to choose whitespace can emit
# it forever. Separators carry the one space json.dumps puts there. A schema's own
# "x-guidance" object overrides these (llguidance applies defaults, then the schema's).
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CHOICES = 1024


def grammar_text(spec: StructuredSpec) -> str:
    """llguidance's grammar for `spec`; RequestError when it is not even well-formed input."""
    if spec.kind == "json":
        return json_grammar(spec)
    if spec.kind == "regex":
        if not spec.value:
            raise RequestError(f"{spec.source}: the regular expression is empty", spec.source)
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(choice_lark(spec))
    if spec.kind == "grammar":
        if not spec.value.strip():
            raise RequestError(f"{spec.source}: the grammar is empty", spec.source)
        return llguidance.LLMatcher.grammar_from_lark(spec.value)
    raise RequestError(f"{spec.source}: unknown constraint kind {spec.kind!r}", spec.source)


def json_schema(spec: StructuredSpec) -> dict:
    """The schema of a kind "json" spec as an object."""
    try:
        schema = json.loads(spec.value or "{}")
    except ValueError as exc:
        raise RequestError(
            f"{spec.source}: the JSON schema is not JSON ({exc})", spec.source
        ) from None
    if isinstance(schema, bool):  # JSON Schema's "true" (anything) and "false" (nothing)
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise RequestError(
            f"{spec.source}: a JSON schema must be an object, got {type(schema).__name__}",
            spec.source,
        )
    return schema


def json_grammar(spec: StructuredSpec) -> str:
    schema = json_schema(spec)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            closed_objects(schema), defaults=JSON_DEFAULTS
        )
    except ValueError as exc:
        raise RequestError(f"{spec.source}: invalid JSON schema: {exc}", spec.source) from None


def embedded_json(schema: dict) -> str:
    """`%json{...}` for a Lark grammar (kind "grammar", e.g. a tool call's arguments): the
    schema generated as kind "json" generates it (closed objects, fixed whitespace)."""
    closed = closed_objects(schema)
    closed["x-guidance"] = {**JSON_DEFAULTS, **schema.get("x-guidance", {})}
    return "%json" + json.dumps(closed)


OPEN_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
SCHEMA_VALUES = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def closed_objects(schema: object, close: bool = True) -> object:
    """A copy of `schema` in which objects that list their properties and say nothing about
    others take no others, as vLLM's default grammar compiler does (xgrammar's strict mode)
    and as OpenAI's strict schemas spell out: a model otherwise pads objects with invented
    keys until max_tokens. The output still satisfies the original schema. allOf members are
    left open, since closing each would forbid the others' properties."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if close and isinstance(out.get("properties"), dict):
        if not any(key in out for key in OPEN_KEYWORDS):
            out["additionalProperties"] = False
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub) for sub in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed_objects(sub, close=False) for sub in out["allOf"]]
    for key in SCHEMA_VALUES:
        if key in out:
            value = out[key]
            if isinstance(value, list):  # draft 4 tuple items
                out[key] = [closed_objects(sub) for sub in value]
            else:
                out[key] = closed_objects(value)
    return out


def answer_lark(spec: StructuredSpec) -> str | None:
    """A Lark expression whose sentences are the spec's, to stand beside other alternatives
    in a grammar; None for kind "grammar" (a whole Lark grammar does not nest)."""
    if spec.kind == "json":
        return embedded_json(json_schema(spec))
    if spec.kind == "regex":
        if not spec.value:
            raise RequestError(f"{spec.source}: the regular expression is empty", spec.source)
        return regex_lark(spec.value)
    if spec.kind == "choice":
        return "(" + choice_alternatives(spec) + ")"
    return None


def regex_lark(pattern: str) -> str:
    """A regular expression as a Lark `/.../` terminal: slashes and line breaks escaped,
    escapes kept as they are."""
    out = []
    chars = iter(pattern)
    for char in chars:
        if char == "\\":
            out.append(char + next(chars, ""))
        elif char == "/":
            out.append("\\/")
        else:
            out.append({"\n": "\\n", "\r": "\\r"}.get(char, char))
    return "/" + "".join(out) + "/"


def choice_lark(spec: StructuredSpec) -> str:
    """A Lark grammar whose sentences are exactly the choices."""
    return f"start: {choice_alternatives(spec)}\n"


def choice_alternatives(spec: StructuredSpec) -> str:
    """The choices as Lark alternatives (JSON string literals are Lark string literals)."""
    if not spec.choices:
        raise RequestError(f"{spec.source}: at least one choice is needed", spec.source)
    if len(spec.choices) > MAX_CHOICES:
        raise RequestError(f"{spec.source}: at most {MAX_CHOICES} choices", spec.source)
    if any(not isinstance(c, str) or c == "" for c in spec.choices):
        raise RequestError(f"{spec.source}: choices must be non-empty strings", spec.source)
    return " | ".join(json.dumps(c) for c in dict.fromkeys(spec.choices))
