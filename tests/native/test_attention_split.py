"""Decode attention over long contexts, split into parts of the keys (att_plan.h: a sequence's
queries that fit one tile, over keys of more than one part, become a work item per part, the
parts fixed ranges of key positions, 1024 keys each, twice that every 16 parts; the last part
to finish merges their partial softmax states): every tier and path (fp32 and bf16
activations, the bf16 decode rows and row groups, odd head dims, int8 / e5m2 / e4m3 caches,
sliding windows, sinks) against the dense torch reference, with the largest score placed in
each part in turn; a query's bits the same decoded alone or inside a verification, and on any
thread count."""

from __future__ import annotations

import pytest
import torch
from test_attention import make_case, ref_attention
from test_attention_sinks_kernels import ref_sink_attention
from tolerances import assert_close

from cpud.ranks.paged_kv import dequantize_kv, quantize_kv

SPLIT_KEYS, SPLIT_GROW = 1024, 16  # att_plan.h ATT_SPLIT_KEYS, ATT_SPLIT_GROW
# decodes at 1024 (one part), 1025 (two), 2048 and 5000, 3 and 8 queries (verifications: split
# where they fit one tile) and a short decode beside them
SEQS = ((5000, 1), (1024, 1), (1025, 1), (2600, 3), (33, 1), (3100, 8), (2048, 1))
LONG = 4  # fp32 sums over thousands of keys: four times the tolerance of short contexts


def part_starts(ctx: int) -> list[int]:
    """The first key of each part a decode over ctx keys is split into (att_plan.h)."""
    starts, start, size = [], 0, SPLIT_KEYS
    while start < ctx:
        for _ in range(SPLIT_GROW):
            if start < ctx:
                starts.append(start)
            start += size
        size *= 2
    return starts


def test_long_decodes_run_as_parts_of_their_keys(kern):
    """The split itself, item by item (the other tests see only its outputs)."""
    qsl = torch.tensor([0, 1, 2, 3, 6, 7, 15, 16], dtype=torch.int32)
    seq_lens = torch.tensor([c for c, _ in SEQS], dtype=torch.int32)

    def items(nh: int, nkv: int) -> int:
        return kern.attention_items(qsl, seq_lens, nh, nkv, 64)

    # 5000 -> 5 parts, 1024 -> 1, 1025 -> 2, the 3 queries at 2600 3, 33 -> 1, the 8 queries at
    # 3100 4, 2048 -> 2
    assert items(8, 2) == 2 * (5 + 1 + 2 + 3 + 1 + 4 + 2)
    assert items(32, 16) == 16 * (5 + 1 + 2 + 3 + 1 + 4 + 2)
    assert items(34, 17) == 17 * 7  # over 16 kv heads: threads enough, never split
    # 16 heads a kv head: tiles of 4 queries, so 8 queries are two tiles, never split
    assert items(16, 1) == 5 + 1 + 2 + 3 + 1 + 2 + 2
    assert [len(part_starts(n)) for n in (1, 1024, 1025, 16384, 16385, 16384 + 2048 + 1)] == [
        1,
        1,
        2,
        16,
        17,
        18,
    ]
    for n in (1023, 1024, 1025, 16384, 16385, 18432, 18433, 1 << 20):
        one = kern.attention_items(qsl[:2], torch.tensor([n], dtype=torch.int32), 4, 1, 64)
        assert one == len(part_starts(n)), n
    with pytest.raises(ValueError, match="attention_items"):
        kern.attention_items(qsl, seq_lens, 8, 3, 64)


@pytest.mark.parametrize(("window", "parts"), [(700, 1), (2047, 3), (2048, 3), (3000, 4)])
def test_a_sliding_window_leaves_out_the_parts_before_it(kern, window, parts):
    """A 5000-key decode's parts start at 0, 1024, 2048, 3072 and 4096; under a window only
    those holding a key it leaves are items."""
    qsl, seq_lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([5000], dtype=torch.int32)
    assert kern.attention_items(qsl, seq_lens, 8, 2, 64, window) == 2 * parts
    assert kern.attention_items(qsl, seq_lens, 8, 2, 64) == 2 * 5


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("G", [2, 4])
def test_a_query_gives_the_same_bits_alone_or_inside_a_verification(kern, cache_dtype, G):
    """Greedy speculative decoding must pick the tokens plain decoding picks: the query at
    position p gives the same output decoded alone (p + 1 keys) as the first of several
    queries verified together (8 and 16 rows a kv head: the bf16 tier's decode-row path; past
    16 the row groups compute differently, before the split too), across part edges and far
    past them.  Quantized caches on the
    avx2 and avx512 tiers are held to closeness only: their generic path's rows already
    differed in the last bits with the keys past them in their last block (avx2, int8,
    p = 1000, before the split too)."""
    exact = cache_dtype == torch.bfloat16 or kern.isa in ("avx512bf16", "amx", "scalar")
    nkv, hd, bs = 2, 64, 16
    a, b = 16 // G, 8 // G  # queries verified: 16 and 8 rows a kv head (the decode-row paths)
    for p in (100, 1020, 1023, 1024, 2046, 4999, 16383):
        seqs = [(p + a, a), (p + b, b), (p + 1, 1)]
        q, kc, vc, qsl, seq_lens, bt = make_case(seqs, G * nkv, nkv, hd, bs, torch.bfloat16, 7)
        # one cache and one table for the three: the same keys at the same positions
        bt[1], bt[2] = bt[0], bt[0]
        q[a], q[a + b] = q[0], q[0]
        if cache_dtype != torch.bfloat16:
            kc, vc = quantize_kv(kc, cache_dtype), quantize_kv(vc, cache_dtype)
        out = kern.paged_attention(q, kc, vc, qsl, seq_lens, bt, hd**-0.5)
        for verified in (out[0], out[a]):
            if exact:
                assert torch.equal(verified, out[a + b]), p
            else:
                assert_close(verified, out[a + b], torch.bfloat16, 1 / 16)


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


@pytest.mark.parametrize("part", range(9))
def test_the_largest_score_in_any_part(kern, part):
    """One key per kv head far above the rest, in each of the nine parts of a 9000-key decode in
    turn: the merge rescales the other parts to that part's max (a part that kept its own max
    would leave the output near the mean of the values)."""
    nh, nkv, hd, bs = 4, 2, 64, 16
    q, kc, vc, qsl, seq_lens, bt = _case(nh, nkv, hd, bs, torch.float32, seqs=((9000, 1),))
    starts = part_starts(9000)
    assert len(starts) == 9
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
