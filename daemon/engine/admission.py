"""A request checked against the model once, with what the check worked out."""

from __future__ import annotations

from dataclasses import dataclass

from cpud.engine.sampling_params import SamplingParams
from cpud.structured.matcher import StartedGrammar


@dataclass(frozen=True)
class Admission:
    """What `LLMEngine.validate` found: the request fits the model and the KV cache.

    `max_tokens` is the output budget (the request's own, else the room left in the context);
    `grammar` is the constraint compiled for this request with its first mask (both worked
    out off the engine thread), or None; each of the request's sequences starts a copy.
    """

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    max_tokens: int
    grammar: StartedGrammar | None = None
    embed: bool = False  # an embedding request (`LLMEngine.validate_embedding` made it)
