"""Turn the last-position logits of each sampling sequence into tokens (runs on rank 0).

Order: banned tokens -> penalties -> greedy argmax, or temperature -> top-k -> top-p ->
min-p -> sample. Logprobs are the raw model distribution (before any processing), as vLLM.
Seeded rows draw their noise from a generator seeded per step, so results do not depend on
what else is in the batch.
"""

from __future__ import annotations

import torch

from cpud.protocol.step import SampledToken, SeqWork


def apply_penalties(logits: torch.Tensor, works: list[SeqWork]) -> None:
    vocab = logits.shape[-1]
    for row, work in enumerate(works):
        spec = work.sampling
        if spec is None:
            continue
        if spec.repetition_penalty != 1.0:
            seen = torch.tensor(work.prompt_token_ids + work.output_token_ids, dtype=torch.long)
            seen = seen[seen < vocab].unique()
            values = logits[row, seen]
            penalty = spec.repetition_penalty
            logits[row, seen] = torch.where(values > 0, values / penalty, values * penalty)
        if (spec.presence_penalty or spec.frequency_penalty) and work.output_token_ids:
            ids = torch.tensor(work.output_token_ids, dtype=torch.long)
            counts = torch.bincount(ids[ids < vocab], minlength=vocab).to(logits.dtype)
            logits[row] -= spec.frequency_penalty * counts
            logits[row] -= spec.presence_penalty * (counts > 0).to(logits.dtype)


def restrict_support(logits: torch.Tensor, works: list[SeqWork]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p for rows that sample; returns probabilities."""
    specs = [w.sampling for w in works]
    temps = torch.tensor([s.temperature for s in specs], dtype=logits.dtype).unsqueeze(1)
    logits = logits / temps
    vocab = logits.shape[-1]
    top_k = torch.tensor([s.top_k if s.top_k > 0 else vocab for s in specs])
    top_p = torch.tensor([s.top_p for s in specs], dtype=logits.dtype)
    if bool((top_k < vocab).any()) or bool((top_p < 1.0).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab).unsqueeze(0)
        drop = ranks >= top_k.clamp(min=1).unsqueeze(1)
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before > top_p.unsqueeze(1)
        drop[:, 0] = False
        logits = torch.empty_like(logits).scatter_(
            1, order, sorted_logits.masked_fill(drop, float("-inf"))
        )
    probs = logits.softmax(dim=-1)
    min_p = torch.tensor([s.min_p for s in specs], dtype=logits.dtype)
    if bool((min_p > 0).any()):
        floor = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def draw(probs: torch.Tensor, works: list[SeqWork], generator: torch.Generator) -> torch.Tensor:
    """Exponential-race sampling: argmax(p / E) with E ~ Exp(1) picks i with probability p_i."""
    noise = torch.empty_like(probs)
    for row, work in enumerate(works):
        row_generator = generator
        if work.seed is not None:
            row_generator = torch.Generator().manual_seed(work.seed)
        noise[row].exponential_(generator=row_generator)
    return (probs / noise).argmax(dim=-1)


def sample(
    logits: torch.Tensor, works: list[SeqWork], generator: torch.Generator
) -> list[SampledToken]:
    """logits: [S, vocab] for the sequences in `works` (all with sample=True)."""
    if all(_plain_greedy(w) for w in works):
        # Nothing to process: argmax of the raw logits; max() is vectorized for bf16 where
        # argmax() is not, and picks the same (first) index.
        tokens = logits.max(dim=-1).indices.tolist()
        return [SampledToken(w.seq_id, t) for w, t in zip(works, tokens)]
    logits = logits.float()
    want_logprobs = any(w.sampling is not None and w.sampling.num_logprobs >= 0 for w in works)
    raw_logprobs = logits.log_softmax(dim=-1) if want_logprobs else None
    processed = logits.clone()
    for row, work in enumerate(works):
        if work.banned_token_ids:
            banned = [t for t in work.banned_token_ids if 0 <= t < processed.shape[-1]]
            processed[row, banned] = float("-inf")
    apply_penalties(processed, works)
    tokens = processed.argmax(dim=-1)
    random_rows = [
        row for row, w in enumerate(works) if w.sampling is not None and w.sampling.temperature
    ]
    if random_rows:
        sub = [works[r] for r in random_rows]
        probs = restrict_support(processed[random_rows], sub)
        tokens[random_rows] = draw(probs, sub, generator)
    return [
        _sampled(work, int(tokens[row]), None if raw_logprobs is None else raw_logprobs[row])
        for row, work in enumerate(works)
    ]


def _plain_greedy(work: SeqWork) -> bool:
    spec = work.sampling
    return not work.banned_token_ids and (
        spec is None
        or (
            spec.temperature == 0
            and spec.num_logprobs < 0
            and spec.repetition_penalty == 1.0
            and spec.presence_penalty == 0.0
            and spec.frequency_penalty == 0.0
        )
    )


def _sampled(work: SeqWork, token: int, logprobs: torch.Tensor | None) -> SampledToken:
    num = -1 if work.sampling is None else work.sampling.num_logprobs
    if logprobs is None or num < 0:
        return SampledToken(work.seq_id, token)
    chosen = float(logprobs[token])
    rank = int((logprobs > logprobs[token]).sum()) + 1
    top_ids: list[int] = []
    top_values: list[float] = []
    if num > 0:
        values, ids = logprobs.topk(num)
        top_ids, top_values = ids.tolist(), values.tolist()
    return SampledToken(work.seq_id, token, chosen, rank, top_ids, top_values)
