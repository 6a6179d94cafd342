"""The ranks' side of the engine's bookkeeping: each step's plan as deltas (protocol/step.py),
what the ranks hold of each sequence, and what they should drop.

A sequence the ranks do not hold gets a NewSeq (sampling settings, logit bias, penalty
history) and its whole block table from an explicit position; later steps carry only its new
tokens and new blocks. Finished, aborted and preempted sequences are named in the next plan's
`dropped`.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Mapping

from cpud.engine.sampling_params import SamplingParams
from cpud.engine.scheduler import SchedulerOutput
from cpud.engine.sequence import Sequence
from cpud.engine.spec_decode import SpecDecoder
from cpud.protocol.step import NewSeq, PromptScoring, SamplingSpec, SeqWork, StepPlan


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers, stable across processes and runs."""
    data = b"".join(int(p).to_bytes(16, "little", signed=True) for p in parts)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def sampling_spec(params: SamplingParams) -> SamplingSpec:
    return SamplingSpec(
        temperature=0.0 if params.greedy else params.temperature,
        top_k=params.top_k if params.top_k > 0 else 0,
        top_p=params.top_p,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        num_logprobs=-1 if params.logprobs is None else params.logprobs,
    )


def end_tokens(params: SamplingParams, eos_token_ids: frozenset[int]) -> frozenset[int]:
    """The end-of-sequence tokens that stop this request (none with ignore_eos)."""
    return frozenset() if params.ignore_eos else eos_token_ids


def prompt_scoring(seq: Sequence, start: int, num_tokens: int) -> PromptScoring | None:
    """Which of the positions [start, start + num_tokens) the step scores for the sequence's
    prompt logprobs: each prompt position but the last, once (a recompute skips those done)."""
    if not seq.needs_prompt_logprobs:
        return None
    done = len(seq.prompt_logprobs)
    if done < start:
        raise RuntimeError(f"prompt positions {done}..{start - 1} were never scored")
    first = max(start, done)
    end = min(start + num_tokens, seq.num_prompt_tokens - 1)
    if first >= end:
        return None
    next_token = seq.token_ids[end] if end == start + num_tokens else None
    return PromptScoring(first - start, end - first, seq.params.prompt_logprobs, next_token)


class StepPlanner:
    def __init__(self, spec: SpecDecoder | None, eos_token_ids: frozenset[int]) -> None:
        self.spec = spec
        self.eos_token_ids = eos_token_ids
        # Sequences the ranks hold and should drop (finished, aborted, preempted): sent with
        # the next plan that reaches them.
        self.to_drop: set[int] = set()
        self._step_ids = itertools.count()

    def plan(
        self,
        sched: SchedulerOutput,
        live: Mapping[int, Sequence],
        fail: Callable[[Sequence, Exception], None],
    ) -> StepPlan:
        """The step's plan: a NewSeq for each sequence the ranks do not hold, each sequence's
        new tokens and blocks, the sequences to drop. A sequence whose part cannot be planned
        goes to `fail`; works of sequences no longer in `live` (their request failed) are left
        out."""
        works, news = [], []
        for item in sched.scheduled:
            seq = item.seq
            try:
                start = seq.num_computed_tokens
                if not seq.on_ranks:
                    news.append(self.new_seq(seq, start))
                work = self.work(seq, start, item.num_tokens, item.samples, item.draft)
            except Exception as exc:
                fail(seq, exc)
                continue
            works.append(work)
        works = [w for w in works if w.seq_id in live]
        news = [n for n in news if n.seq_id in live]
        return StepPlan(next(self._step_ids), works, news, sorted(self.to_drop))

    def sent(self, plan: StepPlan, live: Mapping[int, Sequence]) -> None:
        """The ranks have the plan: they hold its sequences with all their blocks, and have
        dropped what it dropped."""
        self.to_drop.difference_update(plan.dropped)
        for work in plan.seqs:
            seq = live.get(work.seq_id)
            if seq is not None and not seq.finished:
                seq.on_ranks = True
                seq.blocks_on_ranks = len(seq.blocks.block_ids)
            else:
                self.to_drop.add(work.seq_id)  # it ended while the step was planned

    def unsent(self, plan: StepPlan, live: Mapping[int, Sequence]) -> None:
        """The plan never reached the ranks whole: its sequences start again next step (an
        in-process rank may have taken part of it)."""
        for work in plan.seqs:
            self.to_drop.add(work.seq_id)
            seq = live.get(work.seq_id)
            if seq is not None:
                seq.on_ranks, seq.blocks_on_ranks = False, 0

    def forget(self, seq: Sequence) -> None:
        """The ranks drop the sequence with the next plan; if it runs again it starts anew."""
        if self.spec is not None:
            self.spec.take_rewind(seq.seq_id)  # it starts again from an explicit position
        if seq.on_ranks:
            self.to_drop.add(seq.seq_id)
        seq.on_ranks = False
        seq.blocks_on_ranks = 0

    def new_seq(self, seq: Sequence, start: int) -> NewSeq:
        """What the ranks keep of a sequence they start holding at position `start`."""
        if seq.embed:
            return NewSeq(seq.seq_id)
        params = seq.params
        drafts = self.spec is not None and self.spec.needs_history  # a draft model catches up
        history = seq.token_ids[:start] if params.needs_penalties or drafts else []
        return NewSeq(
            seq.seq_id,
            sampling_spec(params),
            [token for token, _ in params.logit_bias],
            [bias for _, bias in params.logit_bias],
            history,
            seq.num_prompt_tokens,
        )

    def work(
        self, seq: Sequence, start: int, num_tokens: int, samples: bool, draft: tuple = ()
    ) -> SeqWork:
        """The sequence's part of the step: its new tokens (then its speculative proposals),
        and its new blocks (all of them, from an explicit position, when the ranks start
        holding it)."""
        tokens = seq.token_ids[start : start + num_tokens - len(draft)] + list(draft)
        table = seq.blocks.block_ids
        rewind = self.spec.take_rewind(seq.seq_id) if self.spec is not None else 0
        if seq.on_ranks:
            at: int | None = None
            blocks = table[seq.blocks_on_ranks :]
        else:
            at, blocks, rewind = start, list(table), 0
        if seq.embed:
            return SeqWork(seq.seq_id, tokens, at, blocks, False, embed=True)
        scoring = prompt_scoring(seq, start, num_tokens)
        if not samples:
            return SeqWork(
                seq.seq_id, tokens, at, blocks, False, prompt_scoring=scoring, rewind=rewind
            )
        params = seq.params
        seed = None
        if seq.seed is not None:
            seed = derive_seed(seq.seed, seq.num_output_tokens)
        banned: list[int] = []
        if seq.num_output_tokens < params.min_tokens:
            banned = sorted(set(params.stop_token_ids) | end_tokens(params, self.eos_token_ids))
        mask = seq.constraint.allowed_mask() if seq.constraint is not None else b""
        masks = self.spec.take_masks(seq.seq_id) if draft and self.spec is not None else []
        seeds = []
        if draft and seq.seed is not None:
            first = seq.num_output_tokens
            seeds = [derive_seed(seq.seed, first + j) for j in range(1, len(draft) + 1)]
        return SeqWork(
            seq.seq_id,
            tokens,
            at,
            blocks,
            True,
            seed,
            banned,
            scoring,
            mask,
            num_draft=len(draft),
            rewind=rewind,
            draft_masks=masks,
            draft_seeds=seeds,
        )
