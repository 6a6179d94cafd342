"""HugeArena: tensors carved in order, 64-byte aligned, from one region advised for huge pages;
over-asking is refused; packed quantized weights taken from it compute as from their own
memory."""

from __future__ import annotations

import pytest
import torch
from test_quant_gemm import weight

from cpud.native import quant
from cpud.native.hugepages import HUGE_PAGE, HugeArena, huge_empty


def test_tensors_follow_each_other_aligned():
    shapes = [(3, 5), (7,), (2, 2, 33), (1,)]
    arena = HugeArena(HugeArena.size_of(shapes, torch.float32))
    got = [arena.take(s, torch.float32) for s in shapes]
    ptrs = [t.data_ptr() for t in got]
    assert all(p % 64 == 0 for p in ptrs)
    assert ptrs == sorted(ptrs)
    for t, nxt in zip(got, ptrs[1:]):
        assert t.data_ptr() + t.numel() * 4 <= nxt < t.data_ptr() + t.numel() * 4 + 64
    assert [tuple(t.shape) for t in got] == shapes
    for i, t in enumerate(got):
        t.fill_(i)
    assert [float(t.float().mean()) for t in got] == [0.0, 1.0, 2.0, 3.0]


def test_over_asking_is_refused():
    arena = HugeArena(HugeArena.size_of([(100,)]))
    arena.take((60,), torch.uint8)
    with pytest.raises(MemoryError, match="asked"):
        arena.take((41,), torch.uint8)
    assert arena.take((4,), torch.uint8).numel() == 4


def test_big_regions_start_on_a_huge_page_boundary():
    t = huge_empty((3 * HUGE_PAGE + 5,), torch.uint8)
    assert t.data_ptr() % HUGE_PAGE == 0
    t[-1] = 7  # the tail is mapped too
    assert int(t[-1]) == 7


def test_packed_weights_from_an_arena_compute_the_same():
    raw, _, own = weight("Q4_K", 96, 512)
    qs_shape, sc_shape = tuple(own.qs.shape), tuple(own.sc.shape)
    arena = HugeArena(HugeArena.size_of([qs_shape, sc_shape] * 2))
    arena.take((1,), torch.uint8)  # the parts below do not start at the region's start
    packed = quant.pack_quantized(raw, "Q4_K", 96, 512, alloc=arena.take)
    assert torch.equal(packed.qs, own.qs) and torch.equal(packed.sc, own.sc)
    x = torch.randn(3, 512)
    assert torch.equal(quant.quant_gemm(x, packed), quant.quant_gemm(x, own))
