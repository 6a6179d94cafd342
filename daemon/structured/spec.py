"""What a request's output is constrained to, as the API layer hands it to the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

StructuredKind = Literal["json", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class StructuredSpec:
    """One constraint on a request's generated text.

    kind "json":    value is a JSON schema as a JSON string; "{}" (any JSON value) or
                    '{"type": "object"}' for response_format json_object.
    kind "regex":   value is a regular expression the whole output must match.
    kind "choice":  choices holds the strings the output must be exactly one of.
    kind "grammar": value is a Lark grammar as llguidance takes it (may embed %json{...}),
                    e.g. the tool-call grammar of a chat template.
    `source` names the request field it came from, for 400 messages ("response_format").
    """

    kind: StructuredKind
    value: str = ""
    choices: tuple[str, ...] = ()
    source: str = "response_format"
