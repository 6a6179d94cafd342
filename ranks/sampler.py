"""Turn the last-position logits of each sampling sequence into tokens (runs on rank 0).

Order: logit_bias -> the grammar's allowed-token mask -> banned tokens -> penalties -> greedy
argmax, or temperature -> top-k -> top-p -> min-p -> sample. Bias and mask come first, as in
vLLM, so greedy picks the best allowed token and penalties cannot revive a masked one.
Logprobs are the raw model distribution (before any processing, logit_bias and the mask
included), as vLLM's default: they say what the model thought, whatever was imposed on it.
Seeded rows draw their noise from a generator seeded per step, so results do not depend on
what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from cpud.protocol.step import PromptLogprobs, SampledToken, SamplingSpec, SeqWork
from cpud.ranks.ops import TorchOps
from cpud.ranks.penalty_counts import PenaltyCounts


@dataclass(frozen=True)
class SamplingRow:
    """What sampling one sequence's next token needs: its settings (held by the rank since
    its NewSeq), this step's seed, bans and grammar mask, and its penalty counts."""

    seq_id: int
    sampling: SamplingSpec | None = None
    seed: int | None = None
    banned_token_ids: Sequence[int] = ()
    penalty: PenaltyCounts | None = None  # the history's token counts, when penalties need it
    uncounted: Sequence[
        int
    ] = ()  # counted output tokens this row does not see (proposals after it)
    allowed_mask: bytes = b""
    bias_token_ids: Sequence[int] = field(default=())
    bias_values: Sequence[float] = field(default=())
    draft_token: int | None = None  # speculative decoding: the proposal this position verifies


def apply_penalties(logits: torch.Tensor, works: list[SamplingRow]) -> None:
    for row, work in enumerate(works):
        if work.sampling is not None and work.penalty is not None:
            work.penalty.apply(logits[row], work.sampling, work.uncounted)


def allowed_tokens(mask: bytes, vocab: int) -> np.ndarray:
    """The packed bitmask (bit t of byte t // 8, LSB first) as uint8 0/1 [vocab]; columns
    past the mask's end are 0 (not allowed)."""
    return np.unpackbits(np.frombuffer(mask, dtype=np.uint8), count=vocab, bitorder="little")


def apply_constraints(logits: torch.Tensor, works: list[SamplingRow]) -> None:
    """Add each row's logit_bias, then set the tokens its grammar forbids to -inf. In numpy on
    logits' memory: one pass per row, none of torch's per-op thread fan-out."""
    rows = [row for row, w in enumerate(works) if w.allowed_mask or w.bias_token_ids]
    if not rows:
        return
    vocab = logits.shape[-1]
    view = logits.detach().numpy()
    for row in rows:
        work = works[row]
        if work.bias_token_ids:
            ids = np.asarray(work.bias_token_ids, dtype=np.int64)
            values = np.asarray(work.bias_values, dtype=view.dtype)
            inside = ids < vocab
            np.add.at(view[row], ids[inside], values[inside])
        if work.allowed_mask:
            np.copyto(view[row], -np.inf, where=allowed_tokens(work.allowed_mask, vocab) == 0)


NUCLEUS_CANDIDATES = 1024  # top logits per row searched for the top-k / top-p set first


def restrict_support(logits: torch.Tensor, works: list[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p for rows that sample; returns probabilities, computed
    in logits' storage where it can (a fresh [32, 152k] fp32 tensor costs ~10 ms of page
    faults here, more than the arithmetic)."""
    specs = [w.sampling for w in works]
    if any(s.temperature != 1.0 for s in specs):
        temps = torch.tensor([s.temperature for s in specs], dtype=logits.dtype).unsqueeze(1)
        logits.div_(temps)
    vocab = logits.shape[-1]
    top_k = torch.tensor([s.top_k if 0 < s.top_k < vocab else vocab for s in specs])
    top_p = torch.tensor([s.top_p for s in specs], dtype=logits.dtype)
    if bool((top_k < vocab).any()) or bool((top_p < 1.0).any()):
        logits = keep_nucleus(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1, out=logits)
    min_p = torch.tensor([s.min_p for s in specs], dtype=logits.dtype)
    if bool((min_p > 0).any()):
        floor = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        probs.masked_fill_(probs < floor, 0.0)
    return probs


def keep_nucleus(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits [S, V] with everything outside each row's top-k set, and then outside the
    smallest prefix of it (by descending probability, renormalised over the top-k set) whose
    mass reaches top_p, set to -inf; the most likely token always stays.

    Searches the NUCLEUS_CANDIDATES highest logits (topk: ~12 ms for 32 x 152k, where a full
    sort takes ~215 ms); a row whose set may extend past them is sorted whole."""
    rows, vocab = logits.shape
    largest_k = max([k for k in top_k.tolist() if k < vocab], default=0)
    width = min(vocab, max(NUCLEUS_CANDIDATES, largest_k))
    values, order = logits.topk(width, dim=-1)
    in_k = torch.arange(width).unsqueeze(0) < top_k.clamp(min=1).unsqueeze(1)
    scaled = (values - values[:, :1]).exp().masked_fill(~in_k, 0.0)
    total = scaled.sum(-1)
    beyond = (top_k > width) & (top_p < 1.0)  # rows whose top-k set is not all candidates
    if bool(beyond.any()):
        total[beyond] = (logits[beyond] - values[beyond, :1]).exp().sum(-1)
    probs = scaled / total.unsqueeze(1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep = in_k & ((mass_before <= top_p.unsqueeze(1)) | (top_p >= 1.0).unsqueeze(1))
    keep[:, 0] = True
    out = torch.full_like(logits, float("-inf"))
    out.scatter_(1, order, values.masked_fill(~keep, float("-inf")))
    unrestricted = (top_k >= vocab) & (top_p >= 1.0)  # rows batched with ones that restrict
    out[unrestricted] = logits[unrestricted]
    overflow = beyond & keep[:, -1]
    if bool(overflow.any()):
        out[overflow] = keep_nucleus_sorted(logits[overflow], top_k[overflow], top_p[overflow])
    return out


def keep_nucleus_sorted(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """keep_nucleus over a full sort of each row: the reference, and the fallback for rows
    whose set runs past the candidates."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab).unsqueeze(0)
    drop = ranks >= top_k.clamp(min=1).unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= (mass_before > top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)  # 1: no nucleus
    drop[:, 0] = False
    return torch.empty_like(logits).scatter_(
        1, order, sorted_logits.masked_fill(drop, float("-inf"))
    )


CDF_BLOCK = 256  # tokens per block of the two-level inverse CDF in draw()


def _last_positive(values: torch.Tensor) -> torch.Tensor:
    """Index of the last positive entry of each row of [S, N] (N - 1 where none is)."""
    positive = (values > 0).flip(-1).to(torch.int8)
    return values.shape[-1] - 1 - positive.argmax(dim=-1)


def draw(probs: torch.Tensor, works: list[SamplingRow], generator: torch.Generator) -> torch.Tensor:
    """One token per row of probs [S, V] (need not sum to 1), by inverse CDF on one uniform
    draw per row: the block of CDF_BLOCK tokens whose cumulative mass passes u * total (block
    masses accumulated in fp64), then the token inside that block the same way. A token is chosen
    with its probability up to fp64 rounding, tokens of zero probability never; one random
    number per row instead of one per vocabulary entry (an exponential race over 152k tokens
    took 100 ms per 32 rows here). Seeded rows draw from their own generator, so a row's token
    does not depend on the rest of the batch."""
    rows, vocab = probs.shape
    uniforms = torch.empty(rows, dtype=torch.float64)
    for row, work in enumerate(works):
        row_generator = generator
        if work.seed is not None:
            row_generator = torch.Generator().manual_seed(work.seed)
        uniforms[row] = torch.rand(1, generator=row_generator, dtype=torch.float64)[0]
    full = vocab - vocab % CDF_BLOCK
    # fp32 sums of 256 (relative error ~1e-7 of each block's own mass), accumulated in fp64
    block_mass = probs[:, :full].reshape(rows, -1, CDF_BLOCK).sum(-1).double()
    if full < vocab:
        block_mass = torch.cat((block_mass, probs[:, full:].sum(-1).double()[:, None]), 1)
    cdf = block_mass.cumsum(-1)
    target = uniforms * cdf[:, -1]
    block = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    block = torch.minimum(block, _last_positive(block_mass))  # u * total rounded up to total
    start = block * CDF_BLOCK
    below = (cdf.gather(1, block[:, None]) - block_mass.gather(1, block[:, None]))[:, 0]
    span = torch.arange(CDF_BLOCK)
    index = (start[:, None] + span).clamp(max=vocab - 1)
    inside = probs.gather(1, index).to(torch.float64)
    inside[(start[:, None] + span) >= vocab] = 0.0
    offset = torch.searchsorted(inside.cumsum(-1), (target - below)[:, None], right=True)[:, 0]
    offset = torch.minimum(offset, _last_positive(inside))
    tokens = (start + offset).clamp_(max=vocab - 1)
    # No positive finite mass (logits all -inf or NaN): the largest entry, else token 0.
    broken = ~torch.isfinite(cdf[:, -1]) | (cdf[:, -1] <= 0)
    if bool(broken.any()):
        tokens[broken] = torch.nan_to_num(probs[broken], nan=-1.0).argmax(dim=-1)
    return tokens


def sample(
    logits: torch.Tensor,
    works: list[SamplingRow],
    generator: torch.Generator,
    argmax: Callable[[torch.Tensor], torch.Tensor] = TorchOps.argmax,
) -> list[SampledToken]:
    """logits: [S, vocab] for the sequences in `works` (all with sample=True); argmax is the
    runner's (ops.argmax) for rows that need nothing but the largest raw logit."""
    if all(_plain_greedy(w) for w in works):
        tokens = argmax(logits).tolist()
        return [SampledToken(w.seq_id, t) for w, t in zip(works, tokens)]
    # a copy either way: the processing below writes into it
    processed = logits.float() if logits.dtype != torch.float32 else logits.clone()
    scored = [row for row, w in enumerate(works) if w.sampling and w.sampling.num_logprobs >= 0]
    raw_logprobs = processed[scored].log_softmax(dim=-1) if scored else None
    apply_constraints(processed, works)
    for row, work in enumerate(works):
        if work.banned_token_ids:
            banned = [t for t in work.banned_token_ids if 0 <= t < processed.shape[-1]]
            processed[row, banned] = float("-inf")
    apply_penalties(processed, works)
    random_rows = [
        row for row, w in enumerate(works) if w.sampling is not None and w.sampling.temperature
    ]
    if len(random_rows) < len(works):
        tokens = processed.argmax(dim=-1)
    else:  # every row samples: no argmax over the vocabulary needed
        tokens = torch.zeros(len(works), dtype=torch.long)
    if random_rows:
        sub = [works[r] for r in random_rows]
        rows = processed if len(random_rows) == len(works) else processed[random_rows]
        probs = restrict_support(rows, sub)
        tokens[random_rows] = draw(probs, sub, generator)
    sampled = [SampledToken(w.seq_id, t) for w, t in zip(works, tokens.tolist())]
    if raw_logprobs is not None:
        for row, entry in zip(scored, _logprobs(raw_logprobs, tokens[scored], works, scored)):
            sampled[row] = entry
    return sampled


def _plain_greedy(work: SamplingRow) -> bool:
    spec = work.sampling
    if work.banned_token_ids or work.allowed_mask or work.bias_token_ids:
        return False
    return spec is None or (
        spec.temperature == 0
        and spec.num_logprobs < 0
        and spec.repetition_penalty == 1.0
        and spec.presence_penalty == 0.0
        and spec.frequency_penalty == 0.0
    )


def _logprobs(
    logprobs: torch.Tensor, tokens: torch.Tensor, works: list[SamplingRow], rows: list[int]
) -> list[SampledToken]:
    """The sampled tokens of `rows` with their raw logprobs [R, V]: each token's logprob and
    1-based rank, and each row's num_logprobs best alternatives; a few tensor operations for
    all rows together."""
    chosen = logprobs.gather(1, tokens.unsqueeze(1))
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    nums = [works[row].sampling.num_logprobs for row in rows]
    width = min(max(nums), logprobs.shape[-1])
    top_values: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if width > 0:
        values, ids = logprobs.topk(width, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    return [
        SampledToken(works[row].seq_id, token, value, rank, top_ids[i][:num], top_values[i][:num])
        for i, (row, token, value, rank, num) in enumerate(
            zip(rows, tokens.tolist(), chosen.squeeze(1).tolist(), ranks, nums)
        )
    ]


PROMPT_ROWS_PER_PASS = 128  # prompt positions per LM-head pass: bounds the [rows, vocab] logits


def score_prompts(
    compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
    hidden: torch.Tensor,
    rows: torch.Tensor,
    targets: torch.Tensor,
    works: list[SeqWork],
) -> list[PromptLogprobs]:
    """Prompt logprobs of the hidden `rows` [R] (works' scoring rows, in order), scored on
    `targets` [R]. Every rank calls it (the LM head gathers across ranks); rank 0 gets the
    results, the others an empty list."""
    num_top = max(w.prompt_scoring.num_top for w in works)
    parts = []
    for start in range(0, rows.numel(), PROMPT_ROWS_PER_PASS):
        logits = compute_logits(hidden[rows[start : start + PROMPT_ROWS_PER_PASS]])
        if logits is not None:
            parts.append(
                prompt_logprobs(logits, targets[start : start + PROMPT_ROWS_PER_PASS], num_top)
            )
    if not parts:
        return []
    chosen, ranks, top_values, top_ids = (torch.cat(column) for column in zip(*parts))
    results = []
    start = 0
    for work in works:
        count, top = work.prompt_scoring.count, work.prompt_scoring.num_top
        end = start + count
        results.append(
            PromptLogprobs(
                work.seq_id,
                chosen[start:end].numpy().tobytes(),
                ranks[start:end].tolist(),
                top_ids[start:end, :top].reshape(-1).tolist(),
                top_values[start:end, :top].contiguous().numpy().tobytes(),
            )
        )
        start = end
    return results


def prompt_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw logprobs of prompt positions: logits [R, V] scored on targets [R]. Returns the
    targets' logprobs [R] and 1-based ranks [R], and the num_top best logprobs and token ids
    [R, num_top] of each row, all float32 / int64."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, targets.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)
    return chosen.squeeze(1), ranks, top_values, top_ids
