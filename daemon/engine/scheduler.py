"""Continuous batching with chunked prefill under a token budget, prefix caching and
preemption by recompute.

Every sequence is "tokens computed so far" vs "tokens known"; a step gives each scheduled
sequence a number of tokens to compute. Running sequences come first (decodes, then unfinished
prefill chunks, each oldest first); waiting ones are admitted in arrival order while budget,
sequence slots and KV blocks last. While requests wait, a running prefill leaves a quarter of
the budget to admit them, so a short request is not held until a long prompt (one scored for
prompt logprobs, say) is prefilled to its end. When a running sequence cannot get a block, the
newest running sequence is preempted: its blocks are freed and it recomputes later. A sequence
that still owes prompt logprobs skips the prefix cache (cached blocks have no logits to score);
its own blocks are cached for others as usual.

An embedding request runs its whole prompt in one step, never chunked, beside the others: it is
admitted in arrival order when the step's remaining budget holds its prompt. One that had to
wait for budget at the head of the queue in the last step goes in this one: the running
sequences leave room for it (a decode may then wait one step). It takes no prefix-cache hit
(pooling needs every position computed); its KV blocks, only when the model has a KV cache,
last for its step (the engine frees them when the vector comes back).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from cpud.engine.block_manager import BlockManager, PrefixHit
from cpud.engine.sequence import SeqStatus, Sequence

NO_HIT = PrefixHit([], [])


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens to compute this step, starting at seq.num_computed_tokens
    draft: tuple[int, ...] = ()  # speculative proposals, the last of num_tokens (spec_decode)

    @property
    def samples(self) -> bool:
        computed = self.seq.num_computed_tokens + self.num_tokens - len(self.draft)
        return computed == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_batched_tokens: int,
        embeddings_use_kv: bool = True,
        proposer: Callable[[Sequence, int], list[int]] | None = None,
    ):
        """embeddings_use_kv: embedding passes write KV blocks (a decoder); False for an
        encoder, whose passes need none. proposer(seq, running): speculative tokens for a
        decoding sequence (verified after its last token in the same step), or None."""
        self.proposer = proposer
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.embeddings_use_kv = embeddings_use_kv
        self.admission_reserve = max(1, max_batched_tokens // 4)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._embedding_waited: Sequence | None = None  # kept waiting at the head last step

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        reserved = self._room_for_waited_embedding()
        limit = self.max_batched_tokens - reserved
        # Decodes first, then prefill chunks, each kind oldest first: a long prefill never
        # holds back the next token of a running stream.
        for seq in sorted(self.running, key=lambda s: s.num_uncomputed > 1):
            budget = limit - out.num_tokens
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted for an older one's blocks
                continue
            if seq.embed:  # its plan failed last step: whole again, when it fits
                if seq.num_uncomputed <= budget:
                    out.scheduled.append(ScheduledSeq(seq, seq.num_uncomputed))
                continue
            count = min(seq.num_uncomputed, budget)
            if count > 1 and not reserved and self._admitting():
                count = min(count, max(1, budget - self.admission_reserve))
            draft = self._draft(seq, count, budget)
            if self._make_room(seq, seq.num_computed_tokens + count + len(draft), out):
                out.scheduled.append(ScheduledSeq(seq, count + len(draft), draft))
        if out.preempted:
            return out
        self._admit(out)
        head = self.waiting[0] if self.waiting else None
        self._embedding_waited = head if head is not None and head.embed else None
        return out

    def _draft(self, seq: Sequence, count: int, budget: int) -> tuple[int, ...]:
        """A decoding sequence's proposals, as many as the budget and free blocks hold."""
        if self.proposer is None or count != 1 or seq.num_uncomputed != 1 or budget < 2:
            return ()
        draft = tuple(self.proposer(seq, len(self.running))[: budget - 1])
        if draft and not self.blocks.can_allocate(seq.blocks, seq.num_tokens + len(draft)):
            return ()
        return draft

    def _admitting(self) -> bool:
        """Requests wait and may be admitted: prefill chunks leave them some budget."""
        return bool(self.waiting) and len(self.running) < self.max_num_seqs

    def _room_for_waited_embedding(self) -> int:
        """The prompt of the embedding that waited at the head of the queue last step, when it
        can be admitted now but for the budget; else 0."""
        seq = self._embedding_waited
        if seq is None or not self.waiting or self.waiting[0] is not seq:
            return 0
        if len(self.running) >= self.max_num_seqs:
            return 0
        if self.embeddings_use_kv and not self.blocks.can_allocate(seq.blocks, seq.num_tokens):
            return 0
        return seq.num_tokens

    def _admit(self, out: SchedulerOutput) -> None:
        """Waiting sequences in arrival order while budget, sequence slots and blocks last."""
        budget = self.max_batched_tokens - out.num_tokens
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.embed:
                count = seq.num_tokens
                if count > budget:
                    break
                if self.embeddings_use_kv:
                    if not self.blocks.can_allocate(seq.blocks, count):
                        break
                    self.blocks.allocate(seq.blocks, count)
                cached = 0
            else:
                hit = (
                    NO_HIT
                    if seq.needs_prompt_logprobs
                    else self.blocks.find_prefix(seq.token_ids, seq.blocks.root)
                )
                cached = hit.num_blocks * self.blocks.block_size
                count = min(seq.num_tokens - cached, budget)
                if not self.blocks.can_allocate(seq.blocks, cached + count, hit):
                    break
                self.blocks.allocate(seq.blocks, cached + count, hit)
            self.waiting.popleft()
            seq.num_computed_tokens = cached
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = min(cached, seq.num_prompt_tokens)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, count))
            budget -= count

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Grow seq's blocks to num_tokens, preempting newer sequences; False if seq itself
        had to be preempted."""
        while not self.blocks.can_allocate(seq.blocks, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            out.scheduled = [item for item in out.scheduled if item.seq is not victim]
            if victim is seq:
                return False
        self.blocks.allocate(seq.blocks, num_tokens)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq.blocks)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq.blocks)
        seq.status = SeqStatus.FINISHED
