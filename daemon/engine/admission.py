"""A request checked against the model once, with what the check worked out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cpud.sampling_params import SamplingParams


@dataclass(frozen=True)
class Admission:
    """What `LLMEngine.validate` found: the request fits the model and the KV cache.

    `max_tokens` is the output budget (the request's own, else the room left in the context);
    `grammar` is the constraint compiled for this request at its start state, or None; the
    engine admits an Admission once, and its first sequence takes that matcher.
    """

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    max_tokens: int
    grammar: Any = None  # llguidance.LLMatcher, kept as an opaque handle here
