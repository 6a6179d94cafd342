"""Every optional field of every request type (nested objects included) takes null as the
field left out: its default, or what null means for it."""

from __future__ import annotations

import msgspec
import pytest
from msgspec import inspect as mi

from cpud.frontend.null_fields import decode_without_unknown_nulls
from cpud.frontend.schemas import REQUEST_TYPES

FUNCTION = {"name": "f", "arguments": "{}"}
# The smallest valid object of each request type: its required fields.
MINIMAL = {
    "CompletionRequest": {"prompt": "hi"},
    "StreamOptions": {},
    "ResponseFormat": {"type": "text"},
    "JsonSchemaFormat": {},
    "StructuredOutputs": {},
    "ChatCompletionRequest": {"messages": [{"role": "user", "content": "hi"}]},
    "ChatMessage": {"role": "user"},
    "TextPart": {"type": "text"},
    "ToolCall": {"id": "c", "function": FUNCTION},
    "FunctionCall": FUNCTION,
    "Tool": {"type": "function", "function": {"name": "f"}},
    "FunctionDef": {"name": "f"},
    "NamedToolChoice": {"type": "function", "function": {"name": "f"}},
    "ToolChoiceFunction": {"name": "f"},
    "TokenizeRequest": {},
    "DetokenizeRequest": {"tokens": [1]},
    "ResponsesRequest": {"input": "hi"},
    "ResponsesTool": {"type": "function", "name": "f"},
    "ResponsesToolChoice": {"type": "function", "name": "f"},
    "TextConfig": {},
    "TextFormat": {"type": "text"},
    "ResponsesReasoning": {},
    "EmbeddingRequest": {"input": "hi"},
}


def struct_types() -> dict[type, mi.StructType]:
    """Every Struct reachable from the request types."""
    found: dict[type, mi.StructType] = {}

    def walk(info: mi.Type) -> None:
        if isinstance(info, mi.StructType):
            if info.cls not in found:
                found[info.cls] = info
                for f in info.fields:
                    walk(f.type)
        elif isinstance(info, mi.UnionType):
            for member in info.types:
                walk(member)
        elif isinstance(info, (mi.ListType, mi.VarTupleType)):
            walk(info.item_type)
        elif isinstance(info, mi.DictType):
            walk(info.value_type)
        elif isinstance(info, mi.Metadata):
            walk(info.type)

    for info in mi.multi_type_info(list(REQUEST_TYPES.values())):
        walk(info)
    return found


OPTIONAL = [
    (cls, field)
    for cls, info in struct_types().items()
    for field in info.fields
    if not field.required
]


def test_every_request_type_has_a_minimal_body():
    assert {cls.__name__ for cls in struct_types()} == set(MINIMAL)
    assert len(OPTIONAL) > 80


@pytest.mark.parametrize(
    ("cls", "field"), OPTIONAL, ids=[f"{c.__name__}.{f.name}" for c, f in OPTIONAL]
)
def test_null_is_the_default(cls, field):
    body = {**MINIMAL[cls.__name__], field.encode_name: None}
    value = getattr(msgspec.json.decode(msgspec.json.encode(body), type=cls), field.name)
    if field.name in cls.null_kept:
        assert value is None
    else:
        assert value == field.default


def test_unknown_null_fields_are_dropped_and_others_named():
    body = {
        "messages": [{"role": "user", "content": "hi", "refusal": None}],
        "functions": None,
        "response_format": {"type": "text", "extra": None},
    }
    decoded = decode_without_unknown_nulls(
        msgspec.json.encode(body), REQUEST_TYPES["ChatCompletionRequest"]
    )
    assert decoded.messages[0].content == "hi" and decoded.response_format.type == "text"
    body["messages"][0]["refusal"] = "no"
    with pytest.raises(msgspec.ValidationError, match="refusal"):
        decode_without_unknown_nulls(
            msgspec.json.encode(body), REQUEST_TYPES["ChatCompletionRequest"]
        )
