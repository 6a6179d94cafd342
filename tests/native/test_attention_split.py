"""Decode attention over long contexts, split into parts of the keys (att_plan.h: a sequence's
query, or up to 8 queries within one tile, over ctx >= 2 * 1024 keys becomes ctx // 1024 work
items, at most 64 over its kv heads, whose partial softmax states the last part to finish
merges): every tier and path (fp32 and bf16
activations, the bf16 decode rows and row groups, odd head dims, int8 / e5m2 / e4m3 caches,
sliding windows that cover some parts and none of others, sinks) against the dense torch
reference, with the largest score placed in each part in turn, and the same bits on any
thread count."""

from __future__ import annotations

import pytest
import torch
from test_attention import make_case, ref_attention
from test_attention_sinks_kernels import ref_sink_attention
from tolerances import assert_close

from cpud.ranks.paged_kv import dequantize_kv, quantize_kv

SPLIT_KEYS, SPLIT_ITEMS = 1024, 64  # att_plan.h ATT_SPLIT_KEYS, ATT_SPLIT_ITEMS
# decodes at 2047 (one item) and 2048 (two parts), one over four parts, 3 and 8 queries (a
# speculative verification: split where they fit one tile) and a short decode beside them
SEQS = ((5000, 1), (2047, 1), (2048, 1), (2600, 3), (33, 1), (3100, 8))
LONG = 4  # fp32 sums over thousands of keys: four times the tolerance of short contexts


def part_starts(ctx: int, nkv: int) -> list[int]:
    """The first key of each part of a decode over ctx keys (att_plan.h's rule)."""
    parts = min(ctx // SPLIT_KEYS, SPLIT_ITEMS // nkv)
    return [k * ctx // parts & ~31 for k in range(parts)] if parts >= 2 else [0]


def test_long_decodes_run_as_parts_of_their_keys(kern):
    """The split itself, item by item (the other tests see only its outputs)."""
    qsl = torch.tensor([0, 1, 2, 3, 6, 7, 15], dtype=torch.int32)
    seq_lens = torch.tensor([c for c, _ in SEQS], dtype=torch.int32)

    def items(nh: int, nkv: int) -> int:
        return kern.attention_items(qsl, seq_lens, nh, nkv, 64)

    # 5000 -> 4 parts, 2047 -> whole, 2048 -> 2 parts, the 3 queries at 2600 2 parts, 33 whole,
    # the 8 queries at 3100 3 parts
    assert items(8, 2) == 2 * (4 + 1 + 2 + 2 + 1 + 3)
    assert items(64, 16) == 16 * (4 + 1 + 2 + 2 + 1 + 3)  # at most 64 parts over the kv heads
    assert items(64, 32) == 32 * (2 + 1 + 2 + 2 + 1 + 2)
    assert items(66, 33) == 33 * 6  # over 32 kv heads: never split
    # 16 heads a kv head: tiles of 4 queries, so 8 queries are two tiles, never split
    assert items(16, 1) == 4 + 1 + 2 + 2 + 1 + 2
    one = torch.tensor([0, 9], dtype=torch.int32)
    assert kern.attention_items(one, torch.tensor([5000], dtype=torch.int32), 2, 1, 64) == 1
    for n in range(2040, 2060):
        one = kern.attention_items(qsl[:2], torch.tensor([n], dtype=torch.int32), 4, 1, 64)
        assert one == (n // SPLIT_KEYS if n >= 2 * SPLIT_KEYS else 1)
    with pytest.raises(ValueError, match="attention_items"):
        kern.attention_items(qsl, seq_lens, 8, 3, 64)


@pytest.mark.parametrize(("window", "parts"), [(700, 1), (2047, 1), (2048, 2), (3000, 2)])
def test_a_sliding_window_splits_the_keys_it_leaves(kern, window, parts):
    """A layer's window bounds the keys a decode reads, so only those are split: a 5000-key
    decode under a window of 700 is one item, not four of which three attend nothing."""
    qsl, seq_lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([5000], dtype=torch.int32)
    assert kern.attention_items(qsl, seq_lens, 8, 2, 64, window) == 2 * parts
    assert kern.attention_items(qsl, seq_lens, 8, 2, 64) == 2 * 4


def _case(nh, nkv, hd, bs, dtype, seed=1, seqs=SEQS):
    q, kc, vc, qsl, seq_lens, bt = make_case(list(seqs), nh, nkv, hd, bs, dtype, seed)
    # larger scores than randn's: peaked softmaxes, so each part's max matters to the merge
    return (q.float() * 3).to(dtype), kc, vc, qsl, seq_lens, bt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("nh", "nkv", "hd", "bs"),
    # one kv head (Gemma 3 270M's shape), GQA 4, 17 heads a kv head (bf16's row groups), odd hd
    [(4, 1, 128, 32), (8, 2, 64, 16), (34, 2, 80, 16), (3, 1, 33, 16)],
)
@pytest.mark.parametrize("window", [0, 700, 3000])
def test_split_decode_matches_the_reference(kern, dtype, nh, nkv, hd, bs, window):
    q, kc, vc, qsl, seq_lens, bt = _case(nh, nkv, hd, bs, dtype)
    out = kern.paged_attention(q, kc, vc, qsl, seq_lens, bt, 0.3, window)
    ref = ref_attention(q, kc, vc, qsl, seq_lens, bt, 0.3, window)
    assert_close(out, ref, dtype, LONG)


@pytest.mark.parametrize(("nkv", "part"), [(2, p) for p in range(8)] + [(16, 3)])
def test_the_largest_score_in_any_part(kern, nkv, part):
    """One key per kv head far above the rest, in each part of a 9000-key decode in turn (eight
    parts with two kv heads, four with sixteen: at most 64 items): the merge rescales the other
    parts to that part's max (a part that kept its own max would leave the output near the mean
    of the values)."""
    nh, hd, bs = 2 * nkv, 64, 16
    q, kc, vc, qsl, seq_lens, bt = _case(nh, nkv, hd, bs, torch.float32, seqs=((9000, 1),))
    starts = part_starts(9000, nkv)
    assert len(starts) == {2: 8, 16: 4}[nkv]
    key = starts[part] + 77
    block, slot = bt[0, key // bs].item(), key % bs
    for h in range(nkv):
        kc[block, h, slot] = q[0, 2 * h] * 4
    ref = ref_attention(q, kc, vc, qsl, seq_lens, bt, 0.125, 0)
    out = kern.paged_attention(q, kc, vc, qsl, seq_lens, bt, 0.125)
    assert_close(out, ref, torch.float32, LONG)
    assert torch.allclose(out[0, 0], vc[block, 0, slot], atol=0.05)  # the one key dominates


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e5m2, torch.float8_e4m3fn])
# G = 4, 4, 3, and 17 (the bf16 tier's row groups)
@pytest.mark.parametrize(("nh", "nkv", "hd"), [(4, 1, 128), (8, 2, 64), (3, 1, 80), (34, 2, 64)])
@pytest.mark.parametrize("window", [0, 1500])
def test_split_decode_on_quantized_caches(kern, cache_dtype, nh, nkv, hd, window):
    q, kc, vc, qsl, seq_lens, bt = _case(nh, nkv, hd, 16, torch.bfloat16, seed=2)
    q = (q.float() / 3).bfloat16()  # the softmax of the quantized tests: int8 rounds q and p
    kq, vq = quantize_kv(kc, cache_dtype), quantize_kv(vc, cache_dtype)
    kd, vd = dequantize_kv(kq, torch.bfloat16), dequantize_kv(vq, torch.bfloat16)
    out = kern.paged_attention(q, kq, vq, qsl, seq_lens, bt, hd**-0.5, window)
    ref = ref_attention(q, kd, vd, qsl, seq_lens, bt, hd**-0.5, window)
    # per token, relative: int8's integer path rounds q and p (up to 2.4 % measured, the same
    # on split and whole items); a part lost or mis-weighted costs tens of percent
    err = (out.float() - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)
    assert (err < 0.04).all(), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 1500])
def test_split_decode_with_sinks(kern, dtype, window):
    """The sink joins the softmax once: in the first part's state, whether or not that part
    attends any key (with the window it attends none)."""
    q, kc, vc, qsl, seq_lens, bt = _case(8, 2, 64, 16, dtype)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(5)) * 2 + 6
    out = kern.paged_attention(q, kc, vc, qsl, seq_lens, bt, 0.125, window, sinks=sinks)
    ref = ref_sink_attention(q, kc, vc, qsl, seq_lens, bt, 0.125, window, sinks)
    assert_close(out, ref, dtype, LONG)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_outputs_do_not_depend_on_the_thread_count(kern, dtype):
    q, kc, vc, qsl, seq_lens, bt = _case(4, 1, 128, 32, dtype)
    old = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(kern.paged_attention(q, kc, vc, qsl, seq_lens, bt, 0.125))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], outs[2])
