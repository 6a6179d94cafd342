"""Flatten a StepPlan into the tensors one forward pass needs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpud.protocol.step import SeqWork, StepPlan
from cpud.ranks.paged_kv import AttentionMetadata


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S_sample] last token of each sampling sequence
    sampling_works: list[SeqWork]
    prompt_rows: torch.Tensor  # [R] rows scored for prompt logprobs, by work in scoring_works
    prompt_targets: torch.Tensor  # [R] the token each of those rows is scored on
    scoring_works: list[SeqWork]
    embed_works: list[SeqWork]  # sequences whose pooled hidden states are returned
    embed_starts: list[int]  # first row of each embed work's tokens
    embed_lens: list[int]


def build_step_inputs(plan: StepPlan, block_size: int, kv: bool = True) -> StepInputs:
    """The step's tensors; `kv` False (a model without KV cache): no slots, block tables unread."""
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
    for work in plan.seqs:
        count = len(work.token_ids)
        starts.append(len(input_ids))
        lens.append(count)
        seq_lens.append(work.start_pos + count)
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
            if work.start_pos != 0 or not count:
                raise ValueError(
                    f"seq {work.seq_id}: an embedding sequence must come whole in one step "
                    f"(start_pos {work.start_pos}, {count} tokens)"
                )
            embed_starts.append(len(input_ids))
        input_ids.extend(work.token_ids)
        positions.extend(range(work.start_pos, work.start_pos + count))
        if kv:
            table = work.block_table
            for pos in range(work.start_pos, work.start_pos + count):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        if work.sample and not work.embed:
            logits_indices.append(len(input_ids) - 1)
    width = max((len(w.block_table) for w in plan.seqs), default=0) if kv else 0
    tables = torch.zeros((len(plan.seqs), max(width, 1)), dtype=torch.long)
    for row, work in enumerate(plan.seqs if kv else ()):
        tables[row, : len(work.block_table)] = torch.tensor(work.block_table, dtype=torch.long)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        block_tables=tables,
        query_starts=starts,
        query_lens=lens,
        seq_lens=seq_lens,
        block_size=block_size,
        query_start_loc=torch.tensor(starts + [len(input_ids)], dtype=torch.int32),
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables_i32=tables.to(torch.int32),
    )
    return StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        meta=meta,
        logits_indices=torch.tensor(logits_indices, dtype=torch.long),
        sampling_works=[w for w in plan.seqs if w.sample and not w.embed],
        prompt_rows=torch.tensor(prompt_rows, dtype=torch.long),
        prompt_targets=torch.tensor(prompt_targets, dtype=torch.long),
        scoring_works=[w for w in plan.seqs if w.prompt_scoring is not None],
        embed_works=[w for w in plan.seqs if w.embed],
        embed_starts=embed_starts,
        embed_lens=[len(w.token_ids) for w in plan.seqs if w.embed],
    )
