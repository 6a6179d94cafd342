"""One request inside the engine: its prompt and the sequences it samples (n of them)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from cpud.engine.outputs import Logprob
from cpud.engine.sequence import Sequence


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    arrival_time: float = field(default_factory=time.monotonic)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # built once, when complete

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    @property
    def awaits_prompt_logprobs(self) -> bool:
        """Its prompt logprobs are not all computed yet (its outputs wait for them)."""
        return self.seqs[0].needs_prompt_logprobs
