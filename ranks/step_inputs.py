"""Flatten a StepPlan into the tensors one forward pass needs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpud.protocol.step import SeqWork, StepPlan
from cpud.ranks.layers.attention import AttentionMetadata


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S_sample] last token of each sampling sequence
    sampling_works: list[SeqWork]


def build_step_inputs(plan: StepPlan, block_size: int) -> StepInputs:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts: list[int] = []
    lens: list[int] = []
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    for work in plan.seqs:
        count = len(work.token_ids)
        starts.append(len(input_ids))
        lens.append(count)
        seq_lens.append(work.start_pos + count)
        input_ids.extend(work.token_ids)
        table = work.block_table
        for pos in range(work.start_pos, work.start_pos + count):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        if work.sample:
            logits_indices.append(len(input_ids) - 1)
    width = max((len(w.block_table) for w in plan.seqs), default=0)
    tables = torch.zeros((len(plan.seqs), max(width, 1)), dtype=torch.long)
    for row, work in enumerate(plan.seqs):
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
        sampling_works=[w for w in plan.seqs if w.sample],
    )
