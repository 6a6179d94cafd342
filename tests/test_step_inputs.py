"""The tensors a rank builds for a step (ranks/step_inputs.py): what each holds for a mixed
step, that a decode step makes them from two Python lists, and that one sequence's block table
is its held row, not a copy."""

from __future__ import annotations

import torch

from cpud.protocol.step import NewSeq, PromptScoring, SamplingSpec, SeqWork, StepPlan
from cpud.ranks.seq_states import SeqStates
from cpud.ranks.step_inputs import build_step_inputs

BLOCK = 4
GREEDY = SamplingSpec(temperature=0.0)


def test_a_mixed_step_holds_each_sequences_rows():
    states = SeqStates()
    plan = StepPlan(
        0,
        [
            SeqWork(1, [5, 6, 7, 8, 9], 0, [3, 8], True, prompt_scoring=PromptScoring(0, 3, 0)),
            SeqWork(2, [11, 12], 4, [2, 6], True),
        ],
        [NewSeq(1, GREEDY), NewSeq(2, GREEDY)],
    )
    inputs = build_step_inputs(plan, states.apply(plan), BLOCK)
    assert inputs.input_ids.tolist() == [5, 6, 7, 8, 9, 11, 12]
    assert inputs.positions.tolist() == [0, 1, 2, 3, 4, 4, 5]
    # token at position p of a sequence goes to block table[p // 4], offset p % 4
    assert inputs.meta.slot_mapping.tolist() == [12, 13, 14, 15, 32, 24, 25]
    assert inputs.logits_indices.tolist() == [4, 6]
    assert inputs.prompt_rows.tolist() == [0, 1, 2]
    assert inputs.prompt_targets.tolist() == [6, 7, 8]
    assert inputs.meta.query_start_loc.tolist() == [0, 5, 7]
    assert inputs.meta.seq_lens_tensor.tolist() == [5, 6]
    assert inputs.meta.block_tables_i32.tolist() == [[3, 8], [2, 6]]
    assert inputs.meta.block_tables.dtype == torch.int64
    assert inputs.meta.block_tables.tolist() == [[3, 8], [2, 6]]
    for tensor, dtype in (
        (inputs.input_ids, torch.int64),
        (inputs.positions, torch.int64),
        (inputs.meta.slot_mapping, torch.int64),
        (inputs.meta.query_start_loc, torch.int32),
        (inputs.meta.seq_lens_tensor, torch.int32),
    ):
        assert tensor.dtype == dtype and tensor.is_contiguous()


def test_block_tables_of_uneven_sequences_are_padded_with_zero():
    states = SeqStates()
    plan = StepPlan(
        0,
        [SeqWork(1, [1, 2, 3, 4, 5], 0, [7, 9], True), SeqWork(2, [1], 0, [4], True)],
        [NewSeq(1, GREEDY), NewSeq(2, GREEDY)],
    )
    inputs = build_step_inputs(plan, states.apply(plan), BLOCK)
    assert inputs.meta.block_tables_i32.tolist() == [[7, 9], [4, 0]]


def test_a_decode_step_makes_its_tensors_from_two_lists_and_reads_the_held_row(monkeypatch):
    states = SeqStates()
    first = StepPlan(0, [SeqWork(1, [1, 2, 3], 0, [5], True)], [NewSeq(1, GREEDY)])
    build_step_inputs(first, states.apply(first), BLOCK)
    made = []
    real_tensor = torch.tensor

    def counting_tensor(data, *args, **kwargs):
        made.append(list(data))
        return real_tensor(data, *args, **kwargs)

    monkeypatch.setattr(torch, "tensor", counting_tensor)
    decode = StepPlan(1, [SeqWork(1, [4], None, [], True)])
    held = states.apply(decode)
    inputs = build_step_inputs(decode, held, BLOCK)
    monkeypatch.undo()
    assert len(made) == 2, made
    assert inputs.input_ids.tolist() == [4] and inputs.positions.tolist() == [3]
    assert inputs.meta.slot_mapping.tolist() == [23]
    table = inputs.meta.block_tables_i32
    assert table.tolist() == [[5]]
    row = held[0].table_row.view(held[0].block_table)
    assert table.data_ptr() == row.data_ptr()
