"""A JSON null is a field left out, even for a field cpud does not know: SDKs send null for
every argument their user passed as None, whatever the server implements. A body refused only
for unknown fields that are all null is decoded again without them."""

from __future__ import annotations

import re
from typing import Any

import msgspec

_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]*)`(?: - at `\$\.?([^`]*)`)?")
_STEP = re.compile(r"\.?([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")
MAX_DROPPED = 64


def _container(data: Any, path: str) -> Any:
    """The object at a msgspec error path ("messages[0].function"), or None."""
    node = data
    for match in _STEP.finditer(path or ""):
        key, index = match.group(1), match.group(2)
        if key is not None and isinstance(node, dict):
            node = node.get(key)
        elif index is not None and isinstance(node, list) and int(index) < len(node):
            node = node[int(index)]
        else:
            return None
    return node


def unknown_null_field(exc: msgspec.ValidationError) -> tuple[str, str] | None:
    """(field, path of the object holding it) when the error is an unknown field."""
    match = _UNKNOWN_FIELD.search(str(exc))
    return None if match is None else (match.group(1), match.group(2) or "")


def decode_without_unknown_nulls(raw: bytes | bytearray, kind: type) -> Any:
    """The body as `kind` once its unknown null fields are dropped; the original error when
    an unknown field is not null (or the body fails for another reason)."""
    data = msgspec.json.decode(raw)
    for _ in range(MAX_DROPPED):
        try:
            return msgspec.convert(data, kind)
        except msgspec.ValidationError as exc:
            found = unknown_null_field(exc)
            if found is None:
                raise
            name, path = found
            holder = _container(data, path)
            if not isinstance(holder, dict) or name not in holder or holder[name] is not None:
                raise
            del holder[name]
    return msgspec.convert(data, kind)
