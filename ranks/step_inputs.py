"""Flatten a StepPlan, with what the rank holds per sequence, into the tensors one forward pass
needs and the rows the sampler reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from cpud.protocol.step import SeqWork, StepPlan
from cpud.ranks.paged_kv import AttentionMetadata
from cpud.ranks.sampler import SamplingRow
from cpud.ranks.seq_states import HeldSeq
from cpud.ranks.spec_verify import draft_rows


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S_sample] last token of each sampling sequence
    sampling_rows: list[SamplingRow]  # of the sampling sequences, in order
    prompt_rows: torch.Tensor  # [R] rows scored for prompt logprobs, by work in scoring_works
    prompt_targets: torch.Tensor  # [R] the token each of those rows is scored on
    scoring_works: list[SeqWork]
    embed_works: list[SeqWork]  # sequences whose pooled hidden states are returned
    embed_starts: list[int]  # first row of each embed work's tokens
    embed_lens: list[int]


def sampling_row(work: SeqWork, held: HeldSeq) -> SamplingRow:
    return SamplingRow(
        work.seq_id,
        held.sampling,
        work.seed,
        work.banned_token_ids,
        held.counts,
        (),
        work.allowed_mask,
        held.bias_token_ids,
        held.bias_values,
    )


def block_tables(held: list[HeldSeq]) -> torch.Tensor:
    """The sequences' block tables padded with 0 to the longest: int32 [S, max(width, 1)], from
    each one's tensor row (a step copies only its new block ids out of the lists)."""
    rows = [state.table_row.view(state.block_table) for state in held]
    width = max((row.shape[0] for row in rows), default=0)
    if not width:
        return torch.zeros((len(held), 1), dtype=torch.int32)
    if len(rows) == 1:  # the row itself: read within the step, before the next one grows it
        return rows[0].unsqueeze(0)
    return pad_sequence(rows, batch_first=True)


def build_step_inputs(
    plan: StepPlan, held: list[HeldSeq], block_size: int, kv: bool = True
) -> StepInputs:
    """The step's tensors; `held`: the rank's state of each of plan.seqs after taking the plan
    (SeqStates.apply). `kv` False (a model without KV cache): no slots, block tables unread."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts: list[int] = []
    lens: list[int] = []
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    prompt_rows: list[int] = []
    prompt_targets: list[int] = []
    embed_starts: list[int] = []
    rows: list[SamplingRow] = []
    for work, state in zip(plan.seqs, held):
        count = len(work.token_ids)
        start_pos = state.step_start
        starts.append(len(input_ids))
        lens.append(count)
        seq_lens.append(start_pos + count)
        scoring = work.prompt_scoring
        if scoring is not None:
            if scoring.first < 0 or scoring.count < 1 or scoring.first + scoring.count > count:
                raise ValueError(f"seq {work.seq_id}: prompt scoring rows outside its tokens")
            base = len(input_ids) + scoring.first
            prompt_rows.extend(range(base, base + scoring.count))
            targets = work.token_ids[scoring.first + 1 : scoring.first + scoring.count + 1]
            if len(targets) < scoring.count and scoring.next_token is not None:
                targets.append(scoring.next_token)
            if len(targets) != scoring.count:
                raise ValueError(f"seq {work.seq_id}: prompt scoring runs past its tokens")
            prompt_targets.extend(targets)
        if work.embed:
            if start_pos != 0 or not count:
                raise ValueError(
                    f"seq {work.seq_id}: an embedding sequence must come whole in one step "
                    f"(start_pos {start_pos}, {count} tokens)"
                )
            embed_starts.append(len(input_ids))
        input_ids.extend(work.token_ids)
        positions.extend(range(start_pos, start_pos + count))
        if kv:
            table = state.block_table
            for pos in range(start_pos, start_pos + count):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        if work.sample and not work.embed and work.num_draft:
            logits_indices.extend(range(len(input_ids) - 1 - work.num_draft, len(input_ids)))
            rows.extend(draft_rows(sampling_row(work, state), work))
        elif work.sample and not work.embed:
            logits_indices.append(len(input_ids) - 1)
            rows.append(sampling_row(work, state))
    tables = block_tables(held) if kv else torch.zeros((len(plan.seqs), 1), dtype=torch.int32)
    # one tensor per dtype, split into views: a step makes two tensors from lists, not eight
    longs = (input_ids, positions, slots, logits_indices, prompt_rows, prompt_targets)
    ids, pos, slot_mapping, logits_at, prompt_at, targets = torch.tensor(
        [v for part in longs for v in part], dtype=torch.long
    ).split([len(part) for part in longs])
    query_start_loc, seq_lens_tensor = torch.tensor(
        [*starts, len(input_ids), *seq_lens], dtype=torch.int32
    ).split([len(starts) + 1, len(seq_lens)])
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_starts=starts,
        query_lens=lens,
        seq_lens=seq_lens,
        block_size=block_size,
        query_start_loc=query_start_loc,
        seq_lens_tensor=seq_lens_tensor,
        block_tables_i32=tables,
    )
    return StepInputs(
        input_ids=ids,
        positions=pos,
        meta=meta,
        logits_indices=logits_at,
        sampling_rows=rows,
        prompt_rows=prompt_at,
        prompt_targets=targets,
        scoring_works=[w for w in plan.seqs if w.prompt_scoring is not None],
        embed_works=[w for w in plan.seqs if w.embed],
        embed_starts=embed_starts,
        embed_lens=[len(w.token_ids) for w in plan.seqs if w.embed],
    )
