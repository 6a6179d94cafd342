"""The draft model of speculative decoding inside a rank.

Every rank runs the whole draft (TP 1) on the same inputs with the same kernels and the same
random draws, so every rank fills in the same proposals with no communication. The draft's KV
cache has its own tensors indexed by the target's block ids and slots: block tables, prefix
hits, preemption and rewinds need nothing of their own.

A work with num_draft = n carries n placeholder tokens after its last real token (at position
L). Per proposing sequence the draft first computes the positions it has not seen up to L (the
accepted tokens of the last step; the whole prompt for a sequence new to it, restarted or after
steps without speculation) and samples d1 from the last, then n - 1 single-token steps at
L + 1 .. L + n - 1, batched across the proposing sequences. Its KV is then valid up to L + n - 1;
a later work that starts earlier (a rewind) lowers that mark.

Greedy rows propose the draft's argmax (after logit_bias); sampling rows draw from the draft's
own distribution q under the request's logit_bias, temperature, top-k, top-p and min-p (not
its penalties: verification needs the q a proposal came from, not the target's), and return q
per position so that rank 0 can verify by rejection sampling (ranks/spec_verify.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import torch

from cpud.protocol.step import SeqWork, StepPlan
from cpud.ranks.sampler import SamplingRow, draw, restrict_support
from cpud.ranks.seq_states import HeldSeq
from cpud.ranks.spec_verify import mixed_seed, processed_logits
from cpud.ranks.step_inputs import StepInputs, build_step_inputs

DRAFT_SEED_PURPOSE = 1
# Most positions per sequence one draft forward catches up on (a long prompt goes in chunks:
# the activations stay bounded like a prefill chunk's).
CATCH_UP_CHUNK = 256  # mixed into a position's seed for the draft's own draw there


class DraftRunner(Protocol):
    """What the proposer uses of the draft's ModelRunner (ranks/model_runner.py)."""

    config: Any  # RunnerConfig: block_size
    model: Any  # the model: forward, compute_logits
    decoder: Any  # FusedDecoder or None
    kv_caches: list
    ops: Any  # argmax
    kv_cache_bytes: int


@dataclass
class DraftSeq:
    """One sequence as the draft knows it: tokens[i] is the token at position offset + i."""

    tokens: list[int] = field(default_factory=list)
    offset: int = 0
    computed: int = 0  # positions [0, computed) hold the draft's KV

    def take(self, start: int, token_ids: list[int]) -> None:
        """A work's tokens from position start on (earlier tokens stay, later ones go)."""
        if start < self.offset:  # never told the tokens before: catch up from here
            self.tokens, self.offset, self.computed = [], start, start
        del self.tokens[start - self.offset :]
        if len(self.tokens) < start - self.offset:  # a gap: known from start on only
            self.tokens, self.offset, self.computed = [], start, start
        self.tokens.extend(token_ids)
        self.computed = max(self.offset, min(self.computed, start))

    def span(self, first: int, end: int) -> list[int]:
        return self.tokens[first - self.offset : end - self.offset]


@dataclass(frozen=True)
class _Proposing:
    index: int  # in plan.seqs
    work: SeqWork
    held: HeldSeq
    last: int  # position of the sequence's last real token
    rows: list[SamplingRow]  # the draft's sampling row per proposal


class DraftProposer:
    def __init__(self, runner: DraftRunner, seed: int) -> None:
        self.runner = runner
        # The same seed on every rank: unseeded draft draws agree across ranks.
        self.generator = torch.Generator().manual_seed(seed)
        self.seqs: dict[int, DraftSeq] = {}

    @property
    def kv_cache_bytes(self) -> int:
        return self.runner.kv_cache_bytes

    def fill(self, plan: StepPlan, held: list[HeldSeq]) -> tuple[StepPlan, dict[int, torch.Tensor]]:
        """The plan with each proposing work's placeholders replaced by the draft's proposals
        (the held histories too), and the draft's distributions q [n, V] of the sampling ones
        by seq_id. `held`: the target's states after taking the plan."""
        self._take(plan, held)
        proposing = [
            self._proposing(index, work, state)
            for index, (work, state) in enumerate(zip(plan.seqs, held))
            if work.num_draft and work.sample and not work.embed
        ]
        if not proposing:
            return plan, {}
        drafts, probs = self._propose(plan.step_id, proposing)
        seqs = list(plan.seqs)
        for item, tokens in zip(proposing, drafts):
            n = item.work.num_draft
            seqs[item.index] = msgspec.structs.replace(
                item.work, token_ids=[*item.work.token_ids[:-n], *tokens]
            )
            if item.held.history is not None:
                item.held.history[-n:] = tokens
            state = self.seqs[item.work.seq_id]
            state.tokens[item.last + 1 - state.offset :] = tokens
            state.computed = item.last + n
            del state.tokens[: item.last + 1 - state.offset]  # rewinds go back no further
            state.offset = item.last + 1
        q = {item.work.seq_id: p for item, p in zip(proposing, probs) if p is not None}
        return msgspec.structs.replace(plan, seqs=seqs), q

    def _take(self, plan: StepPlan, held: list[HeldSeq]) -> None:
        for seq_id in plan.dropped:
            self.seqs.pop(seq_id, None)
        for new in plan.new_seqs:
            self.seqs[new.seq_id] = DraftSeq(list(new.history))
        for work, state in zip(plan.seqs, held):
            seq = self.seqs.get(work.seq_id)
            if seq is None:
                seq = self.seqs[work.seq_id] = DraftSeq([], state.step_start, state.step_start)
            seq.take(state.step_start, work.token_ids)

    def _proposing(self, index: int, work: SeqWork, held: HeldSeq) -> _Proposing:
        n = work.num_draft
        spec = held.sampling
        if spec is not None:  # the draft's q: the request's filtering, no penalties
            spec = msgspec.structs.replace(
                spec,
                repetition_penalty=1.0,
                presence_penalty=0.0,
                frequency_penalty=0.0,
                num_logprobs=-1,
            )
        seeds: list[int | None] = [None] * n
        if work.seed is not None:
            seeds = [mixed_seed(s, DRAFT_SEED_PURPOSE) for s in [work.seed, *work.draft_seeds][:n]]
        row = SamplingRow(
            work.seq_id,
            spec,
            bias_token_ids=held.bias_token_ids,
            bias_values=held.bias_values,
        )
        rows = [dataclasses.replace(row, seed=seed) for seed in seeds]
        return _Proposing(index, work, held, held.position - n - 1, rows)

    def _propose(
        self, step_id: int, proposing: list[_Proposing]
    ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        self._catch_up(step_id, proposing)
        drafts: list[list[int]] = [[] for _ in proposing]
        probs: list[list[torch.Tensor]] = [[] for _ in proposing]
        for j in range(max(item.work.num_draft for item in proposing)):
            works, states, rows, members = [], [], [], []
            for m, item in enumerate(proposing):
                if j >= item.work.num_draft:
                    continue
                seq = self.seqs[item.work.seq_id]
                if j == 0:  # catch up on what the draft has not seen, up to the last token
                    start = seq.computed
                    tokens = seq.span(start, item.last + 1)
                else:
                    start, tokens = item.last + j, [drafts[m][-1]]
                works.append(SeqWork(item.work.seq_id, tokens, start, [], True))
                states.append(_at(item.held, start, len(tokens)))
                rows.append(item.rows[j])
                members.append(m)
            logits = self._logits(StepPlan(step_id, works), states)
            tokens, q = self._sample(logits, rows)
            for row, m in enumerate(members):
                drafts[m].append(tokens[row])
                if q is not None and not greedy(rows[row]):
                    probs[m].append(q[row])
        stacked = [torch.stack(p) if p else None for p in probs]
        return drafts, stacked

    def _catch_up(self, step_id: int, proposing: list[_Proposing]) -> None:
        """Draft KV for all but the last CATCH_UP_CHUNK unseen positions before each proposing
        sequence's last token, CATCH_UP_CHUNK positions per sequence and forward."""
        while True:
            works, states = [], []
            for item in proposing:
                seq = self.seqs[item.work.seq_id]
                if item.last + 1 - seq.computed <= CATCH_UP_CHUNK:
                    continue
                start = seq.computed
                tokens = seq.span(start, start + CATCH_UP_CHUNK)
                works.append(SeqWork(item.work.seq_id, tokens, start, [], False))
                states.append(_at(item.held, start, len(tokens)))
                seq.computed = start + len(tokens)
            if not works:
                return
            self._hidden(StepPlan(step_id, works), states)

    def _logits(self, plan: StepPlan, states: list[HeldSeq]) -> torch.Tensor:
        hidden, inputs = self._hidden(plan, states)
        return self.runner.model.compute_logits(hidden[inputs.logits_indices])

    def _hidden(self, plan: StepPlan, states: list[HeldSeq]) -> tuple[torch.Tensor, StepInputs]:
        """The draft's hidden states of the plan's tokens (their KV written), and its inputs."""
        runner = self.runner
        inputs = build_step_inputs(plan, states, runner.config.block_size)
        if runner.decoder is not None:
            hidden = runner.decoder.forward(inputs.input_ids, inputs.positions, inputs.meta)
        else:
            hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
        return hidden, inputs

    def _sample(
        self, logits: torch.Tensor, rows: list[SamplingRow]
    ) -> tuple[list[int], torch.Tensor | None]:
        """The draft's token per row, and its distributions q (None when every row is greedy):
        argmax for greedy rows, a draw from q for sampling rows."""
        if all(greedy(row) and not row.bias_token_ids for row in rows):
            return self.runner.ops.argmax(logits).tolist(), None
        processed = processed_logits(logits, rows)
        tokens = processed.argmax(dim=-1).tolist()
        sampling = [i for i, row in enumerate(rows) if not greedy(row)]
        if not sampling:
            return tokens, None
        picked = [rows[i] for i in sampling]
        q = restrict_support(processed[sampling], picked)
        q = q / q.sum(dim=-1, keepdim=True)
        drawn = draw(q, picked, self.generator).tolist()
        full = torch.zeros_like(processed)
        full[sampling] = q
        for i, token in zip(sampling, drawn):
            tokens[i] = int(token)
        return tokens, full


def _at(held: HeldSeq, start: int, count: int) -> HeldSeq:
    """The target's sequence as a draft forward over `count` tokens from `start` sees it: the
    same block table (and its tensor row)."""
    return HeldSeq(held.block_table, start + count, start, table_row=held.table_row)


def greedy(row: SamplingRow) -> bool:
    return row.sampling is None or row.sampling.temperature == 0
