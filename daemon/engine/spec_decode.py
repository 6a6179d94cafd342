"""The engine's side of speculative decoding: which sequences propose how many tokens this step
(n-gram lookup, the adaptive off-switches), what the ranks accepted, and the counters.

A proposing sequence computes its last token and its k proposals in one step, as k+1 query
positions; rank 0 verifies them (ranks/spec_verify.py) and returns the accepted proposals
plus one token of its own. The rejected positions' KV is simply overwritten later: the next
step tells the ranks to go back that many positions (SeqWork.rewind).

With a draft model ("draft_model") the engine only reserves the k+1 positions: the sequence's
work carries k placeholder tokens (num_draft = k) that every rank replaces with its draft
model's proposals before the target verifies them (ranks/spec_draft.py); the ranks keep the
draft's KV under the target's block ids and catch it up on the tokens it has not seen (whence
NewSeq.history for a sequence the ranks start holding part way: needs_history).

A grammar-constrained sequence proposes only what its grammar takes (cut at the first token it
refuses or that ends it) and sends the grammar's mask after each proposal, so every position
is verified under its own mask. Off for a sequence while min_tokens bans tokens, and, for a
while, when its proposals keep being rejected."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cpud.engine.sequence import Sequence
from cpud.engine.spec_ngram import NgramIndex
from cpud.settings.speculative import SpeculativeConfig, parse_speculative_config

if TYPE_CHECKING:
    from cpud.settings.config import EngineConfig

log = logging.getLogger("cpud.engine")

# Adaptive off-switch: an exponential average of each sequence's accepted fraction; below
# LOW_ACCEPTANCE the sequence stops proposing for PAUSE_STEPS decode steps, then tries again.
ACCEPTANCE_DECAY = 0.7
LOW_ACCEPTANCE = 0.2
PAUSE_STEPS = 16
# What a draft-model proposal is until a rank's draft model fills it in.
DRAFT_PLACEHOLDER = 0


@dataclass
class SpecStats:
    """Counters since the engine started (read by /metrics)."""

    num_drafts: int = 0  # steps in which a sequence verified proposals
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying step yields on average: accepted proposals plus the one the
        target model adds."""
        if not self.num_drafts:
            return 0.0
        return 1.0 + self.num_accepted_tokens / self.num_drafts


@dataclass
class _SeqSpec:
    index: NgramIndex | None  # None: a draft model proposes
    acceptance: float = 1.0
    paused: int = 0  # decode steps left without proposals
    rewind: int = 0  # rejected positions the ranks still hold past the sequence's end
    masks: list[bytes] = field(default_factory=list)  # grammar masks after the proposals


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.seqs: dict[int, _SeqSpec] = {}
        self.stats = SpecStats(accepted_per_position=[0] * config.num_speculative_tokens)

    @property
    def needs_history(self) -> bool:
        """The ranks need the tokens before a sequence's first work (its draft catches up)."""
        return self.config.uses_draft_model

    def _state(self, seq: Sequence) -> _SeqSpec:
        state = self.seqs.get(seq.seq_id)
        if state is None:
            config = self.config
            index = None
            if not config.uses_draft_model:
                index = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
            state = self.seqs[seq.seq_id] = _SeqSpec(index)
        return state

    def propose(self, seq: Sequence, num_running: int) -> list[int]:
        """Proposals for a decoding sequence's next positions ([] for none this step)."""
        if num_running > self.config.disable_by_batch_size or seq.embed:
            return []
        if seq.num_output_tokens < seq.params.min_tokens:
            return []
        if self.config.uses_draft_model and seq.constraint is not None:
            return []  # the engine cannot mask proposals it does not see
        # Room: every accepted proposal plus the target's own token stay within max_tokens and
        # the context.
        room = min(
            self.config.num_speculative_tokens,
            seq.max_tokens - seq.num_output_tokens - 1,
            self.max_model_len - seq.num_tokens - 1,
        )
        if room < 1:
            return []
        state = self._state(seq)
        if state.paused:
            state.paused -= 1
            return []
        if state.index is None:
            return [DRAFT_PLACEHOLDER] * room
        draft = state.index.propose(seq.token_ids, room)
        if draft and seq.constraint is not None:
            draft, state.masks = seq.constraint.draft_masks(draft)
            state.masks = state.masks[1:] if draft else []
        return draft

    def take_masks(self, seq_id: int) -> list[bytes]:
        """The grammar masks after each of the sequence's proposals just made (once)."""
        state = self.seqs.get(seq_id)
        if state is None:
            return []
        masks, state.masks = state.masks, []
        return masks

    def record(self, seq_id: int, num_draft: int, num_accepted: int) -> None:
        """What the ranks made of a sequence's num_draft proposals."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_draft
        stats.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            stats.accepted_per_position[position] += 1
        state = self.seqs.get(seq_id)
        if state is None:
            return
        state.rewind = num_draft - num_accepted
        fraction = num_accepted / num_draft
        state.acceptance = ACCEPTANCE_DECAY * state.acceptance + (1 - ACCEPTANCE_DECAY) * fraction
        if state.acceptance < LOW_ACCEPTANCE:
            state.paused = PAUSE_STEPS
            state.acceptance = 2 * LOW_ACCEPTANCE  # a fresh chance after the pause

    def take_rewind(self, seq_id: int) -> int:
        """Rejected positions to drop on the ranks before the sequence's next work (once)."""
        state = self.seqs.get(seq_id)
        if state is None:
            return 0
        rewind, state.rewind = state.rewind, 0
        return rewind

    def forget(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)


def spec_decoder(config: EngineConfig) -> SpecDecoder | None:
    """The engine's speculative decoder as its config says (None: off); logs the setting."""
    spec = parse_speculative_config(config.speculative_config)
    if spec is None:
        return None
    log.info("speculative decoding: %s", spec.describe())
    return SpecDecoder(spec, config.max_model_len)
