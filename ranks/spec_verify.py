"""Verify speculative proposals on rank 0: a sequence that proposed k tokens has k+1 sampling
rows (the positions of its last token and of each proposal, in order); each row's logits are
processed as plain sampling would process them at that position (logit_bias, bans, penalties
over the history up to it, temperature, top-k, top-p, min-p), then:

- greedy: accept proposals while each equals the argmax; the first argmax that differs (or the
  one after the last proposal) is the sequence's own next token;
- sampling: rejection sampling: accept proposal t with probability min(1, p(t) / q(t)); on
  rejection sample from the normalised residual max(p - q, 0); after k acceptances sample the
  bonus token from the last row's p. The emitted tokens are so distributed exactly as the
  target model's own samples. A draft model gives its q per position (ranks/spec_draft.py);
  n-gram lookup's q is one-hot, where this is: accept t with probability p(t), on rejection
  draw from p without t.

Seeded rows carry the seed plain decoding would use at each position (SeqWork.draft_seeds), so
a seeded request gives the same tokens with or without speculation, however the batch looks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import replace

import torch

from cpud.protocol.step import SampledToken, SeqWork
from cpud.ranks.ops import TorchOps
from cpud.ranks.sampler import (
    SamplingRow,
    _logprobs,
    apply_constraints,
    apply_penalties,
    draw,
    restrict_support,
    sample,
)


def mixed_seed(seed: int, *parts: int) -> int:
    """A 63-bit seed from a step's seed and integers (position, purpose)."""
    data = b"".join(int(p).to_bytes(16, "little", signed=True) for p in (seed, *parts))
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def draft_rows(base: SamplingRow, work: SeqWork) -> list[SamplingRow]:
    """The k+1 sampling rows of a work with k proposals: base is the row of its last position
    (with the history up to and including every proposal); row j sees the history up to its
    own position, the grammar's mask there, and carries the proposal it verifies (None on the
    last row)."""
    k = work.num_draft
    drafts = work.token_ids[len(work.token_ids) - k :]
    masks = [base.allowed_mask, *work.draft_masks] if work.draft_masks else None
    seeds = [base.seed, *work.draft_seeds] if base.seed is not None else [None] * (k + 1)
    rows = []
    for j in range(k + 1):
        seed = seeds[j] if j < len(seeds) else mixed_seed(base.seed, j)
        rows.append(
            replace(
                base,
                seed=seed,
                allowed_mask=masks[j] if masks is not None else base.allowed_mask,
                uncounted=drafts[j:] if base.penalty is not None else (),
                draft_token=drafts[j] if j < k else None,
            )
        )
    return rows


# Mixed into a position's seed for the uniform that accepts a draft model's proposal, and for
# the residual draw after a rejection (the draft's own draw uses 1: ranks/spec_draft.py).
ACCEPT_SEED_PURPOSE = 2
RESIDUAL_SEED_PURPOSE = 3


def processed_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """fp32 copies of the rows' logits with logit_bias, grammar masks, bans and penalties."""
    processed = logits.float() if logits.dtype != torch.float32 else logits.clone()
    apply_constraints(processed, rows)
    for row, work in enumerate(rows):
        if work.banned_token_ids:
            banned = [t for t in work.banned_token_ids if 0 <= t < processed.shape[-1]]
            processed[row, banned] = float("-inf")
    apply_penalties(processed, rows)
    return processed


def verify(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    generator: torch.Generator,
    argmax: Callable[[torch.Tensor], torch.Tensor] = TorchOps.argmax,
    resample_residual: bool = True,
    draft_probs: torch.Tensor | None = None,
) -> list[SampledToken]:
    """One sequence's emitted tokens from its k+1 rows' logits [k+1, V]: the accepted proposals
    and one more. draft_probs: the proposer's q [k, V] (normalised) for a sampling sequence;
    None: one-hot. resample_residual False draws a rejected position from p itself instead of
    the residual (wrong: only tests use it, to see the distribution test fail)."""
    k = len(rows) - 1
    drafts = [row.draft_token for row in rows[:k]]
    spec = rows[0].sampling
    plain = all(r.sampling is None or r.sampling.temperature == 0 for r in rows) and all(
        not (r.allowed_mask or r.bias_token_ids or r.banned_token_ids) for r in rows
    )
    plain = plain and (spec is None or (spec.num_logprobs < 0 and not _penalised(spec)))
    tokens: list[int] = []
    if plain:
        targets = argmax(logits).tolist()
        tokens = _accept_greedy(targets, drafts)
    else:
        processed = processed_logits(logits, rows)
        if spec is None or spec.temperature == 0:
            tokens = _accept_greedy(processed.argmax(dim=-1).tolist(), drafts)
        else:
            probs = restrict_support(processed, rows)
            if draft_probs is None:
                tokens = _accept_sampled(probs, rows, drafts, generator, resample_residual)
            else:
                tokens = _accept_drafted(
                    probs, draft_probs, rows, drafts, generator, resample_residual
                )
    emitted = [SampledToken(row.seq_id, t) for row, t in zip(rows, tokens)]
    if spec is not None and spec.num_logprobs >= 0:
        count = len(tokens)
        raw = logits[:count].float().log_softmax(dim=-1)
        emitted = _logprobs(raw, torch.tensor(tokens), rows[:count], list(range(count)))
    return emitted


def _penalised(spec) -> bool:
    return (
        spec.repetition_penalty != 1.0
        or spec.presence_penalty != 0.0
        or spec.frequency_penalty != 0.0
    )


def _accept_greedy(targets: list[int], drafts: list[int | None]) -> list[int]:
    tokens = []
    for target, draft in zip(targets, [*drafts, None]):
        tokens.append(target)
        if target != draft:
            break
    return tokens


def _accept_sampled(
    probs: torch.Tensor,
    rows: list[SamplingRow],
    drafts: list[int | None],
    generator: torch.Generator,
    resample_residual: bool,
) -> list[int]:
    """Each position draws its own sample x ~ p (the draw plain decoding makes there, with
    the same seed); proposal t is accepted when x == t, which happens with probability p(t),
    and a rejected position emits x, distributed as p without t renormalised: the residual
    max(p - q, 0) of rejection sampling with a one-hot q. So the emitted tokens are the
    target's, and a seeded request's are those it gets without speculation."""
    tokens = []
    for j, draft in enumerate(drafts):
        sampled = int(draw(probs[j : j + 1], rows[j : j + 1], generator)[0])
        tokens.append(sampled)
        if sampled == draft:
            continue
        if not resample_residual:  # the wrong verifier: a fresh draw from p, t included
            row = rows[j]
            if row.seed is not None:
                row = replace(row, seed=mixed_seed(row.seed, -2))
            tokens[-1] = int(draw(probs[j : j + 1], [row], generator)[0])
        return tokens
    tokens.append(int(draw(probs[-1:], rows[-1:], generator)[0]))
    return tokens


def _accept_drafted(
    probs: torch.Tensor,
    q: torch.Tensor,
    rows: list[SamplingRow],
    drafts: list[int | None],
    generator: torch.Generator,
    resample_residual: bool,
) -> list[int]:
    """Rejection sampling against a draft model's q: proposal t (drawn from q) is accepted when
    u * q(t) < p(t), u uniform, i.e. with probability min(1, p(t) / q(t)); a rejected position
    draws from max(p - q, 0) renormalised. Seeded rows take u and the residual draw from their
    position's seed, so a seeded request gives the same tokens every time."""
    p = probs / probs.sum(dim=-1, keepdim=True)
    tokens: list[int] = []
    for j, draft in enumerate(drafts):
        row = rows[j]
        if float(_uniform(row, generator)) * float(q[j, draft]) < float(p[j, draft]):
            tokens.append(int(draft))
            continue
        residual = (p[j] - q[j]).clamp_min_(0.0) if resample_residual else p[j]
        if not float(residual.sum()) > 0.0:  # p == q: a rejection cannot happen but by rounding
            residual = p[j]
        if row.seed is not None:
            row = replace(row, seed=mixed_seed(row.seed, RESIDUAL_SEED_PURPOSE))
        tokens.append(int(draw(residual[None], [row], generator)[0]))
        return tokens
    tokens.append(int(draw(probs[-1:], rows[-1:], generator)[0]))
    return tokens


def _uniform(row: SamplingRow, generator: torch.Generator) -> float:
    if row.seed is not None:
        generator = torch.Generator().manual_seed(mixed_seed(row.seed, ACCEPT_SEED_PURPOSE))
    return float(torch.rand(1, generator=generator, dtype=torch.float64)[0])


def sample_or_verify(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    generator: torch.Generator,
    argmax: Callable[[torch.Tensor], torch.Tensor] = TorchOps.argmax,
    draft_probs: dict[int, torch.Tensor] | None = None,
) -> list[SampledToken]:
    """The step's tokens: plain rows sampled together as always; each proposing sequence
    (consecutive rows of one seq_id, proposals in draft_token) verified, emitting its accepted
    proposals and one more token, in order. draft_probs: a draft model's q per seq_id."""
    if all(row.draft_token is None for row in rows):
        return sample(logits, rows, generator, argmax)
    groups: list[list[int]] = []  # row indexes of each sequence
    for index, row in enumerate(rows):
        last = rows[groups[-1][-1]] if groups else None
        if last is not None and last.draft_token is not None and last.seq_id == row.seq_id:
            groups[-1].append(index)  # the positions after a proposal belong to its sequence
        else:
            groups.append([index])
    singles = [g[0] for g in groups if len(g) == 1]
    by_row: dict[int, list[SampledToken]] = {}
    if singles:
        picked = sample(logits[singles], [rows[i] for i in singles], generator, argmax)
        by_row.update((i, [token]) for i, token in zip(singles, picked))
    for group in groups:
        if len(group) > 1:
            part = logits[group[0] : group[-1] + 1]
            group_rows = [rows[i] for i in group]
            q = draft_probs.get(group_rows[0].seq_id) if draft_probs else None
            by_row[group[0]] = verify(part, group_rows, generator, argmax, draft_probs=q)
    return [token for group in groups for token in by_row[group[0]]]
