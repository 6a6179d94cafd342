"""Paged attention (decode + chunked prefill, GQA, sliding window) vs a dense torch reference."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from tolerances import assert_close

# (context length incl. this step, query tokens this step): a fresh 1-token
# prompt, a whole 7-token prompt, decode at 33, a 5-token chunk at 130.
SEQS = [(1, 1), (7, 7), (33, 1), (130, 5)]


def make_case(seqs, nh, nkv, hd, bs, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_lens = [q for _, q in seqs]
    T = sum(q_lens)
    max_blocks = max(math.ceil(c / bs) for c, _ in seqs) + 1  # one unused column
    need = sum(math.ceil(c / bs) for c, _ in seqs)
    num_blocks = need + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    bt = torch.full((len(seqs), max_blocks), -1, dtype=torch.int32)
    used = 0
    for s, (ctx, _) in enumerate(seqs):
        n = math.ceil(ctx / bs)
        bt[s, :n] = torch.tensor(perm[used : used + n], dtype=torch.int32)
        used += n
    kc = torch.randn(num_blocks, nkv, bs, hd, generator=g).to(dtype)
    vc = torch.randn(num_blocks, nkv, bs, hd, generator=g).to(dtype)
    q = torch.randn(T, nh, hd, generator=g).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([c for c, _ in seqs], dtype=torch.int32)
    return q, kc, vc, qsl, seq_lens, bt


def ref_attention(q, kc, vc, qsl, seq_lens, bt, scale, window):
    T, nh, hd = q.shape
    nkv, bs = kc.shape[1], kc.shape[2]
    out = torch.zeros(T, nh, hd)
    for s in range(len(seq_lens)):
        ctx, t0, t1 = int(seq_lens[s]), int(qsl[s]), int(qsl[s + 1])
        q_len = t1 - t0
        blocks = bt[s, : math.ceil(ctx / bs)].long()
        k = kc[blocks].permute(1, 0, 2, 3).reshape(nkv, -1, hd)[:, :ctx].float()
        v = vc[blocks].permute(1, 0, 2, 3).reshape(nkv, -1, hd)[:, :ctx].float()
        k = k.repeat_interleave(nh // nkv, 0)  # [nh, ctx, hd]
        v = v.repeat_interleave(nh // nkv, 0)
        scores = torch.einsum("thd,hjd->htj", q[t0:t1].float(), k) * scale
        pos = torch.arange(ctx - q_len, ctx)[:, None]
        j = torch.arange(ctx)[None, :]
        mask = j <= pos
        if window:
            mask &= j > pos - window
        scores = scores.masked_fill(~mask, float("-inf"))
        out[t0:t1] = torch.einsum("htj,hjd->thd", scores.softmax(-1), v)
    return out


@functools.cache
def case_and_ref(seqs, nh, nkv, hd, bs, dtype, seed, scale, window):
    """Inputs and reference output, shared by every ISA tier."""
    case = make_case(list(seqs), nh, nkv, hd, bs, dtype, seed)
    return case, ref_attention(*case, scale, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hd", [64, 80, 128])
@pytest.mark.parametrize("bs", [16, 128])
@pytest.mark.parametrize("gqa", [1, 4, 8])
def test_paged_attention(kern, dtype, hd, bs, gqa):
    nkv = 2
    scale = hd**-0.5
    case, ref = case_and_ref(tuple(SEQS), nkv * gqa, nkv, hd, bs, dtype, 0, scale, 0)
    assert_close(kern.paged_attention(*case, scale), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 5, 20])
def test_paged_attention_sliding_window(kern, dtype, window):
    case, ref = case_and_ref(tuple(SEQS), 4, 1, 64, 16, dtype, 1, 0.125, window)
    assert_close(kern.paged_attention(*case, 0.125, sliding_window=window), ref, dtype)


def test_paged_attention_long_prefill_tiles(kern):
    # More query rows than one work item holds (64 rows): several query tiles.
    case, ref = case_and_ref(((150, 150), (40, 3)), 4, 2, 64, 16, torch.float32, 2, 0.1, 0)
    assert_close(kern.paged_attention(*case, 0.1), ref, torch.float32)


def test_paged_attention_more_heads_per_kv_head_than_a_tile(kern):
    # G = 72 query heads per kv head (> the 64 rows of one work item).
    case, ref = case_and_ref(((20, 3), (9, 1)), 72, 1, 64, 16, torch.bfloat16, 4, 0.125, 0)
    assert_close(kern.paged_attention(*case, 0.125), ref, torch.bfloat16)


def test_paged_attention_strided_query_and_padding_rows(kern):
    nkv, nh, hd, bs = 2, 8, 80, 16
    q, kc, vc, qsl, seq_lens, bt = make_case(SEQS, nh, nkv, hd, bs, torch.bfloat16, seed=3)
    T = q.shape[0]
    qkv = torch.zeros(T + 2, (nh + 2 * nkv) * hd, dtype=torch.bfloat16)
    qkv[:T, : nh * hd] = q.reshape(T, -1)
    qview = qkv[:, : nh * hd].view(T + 2, nh, hd)  # two padding tokens at the end
    out = torch.full((T + 2, nh, hd), 7.0, dtype=torch.bfloat16)
    kern.paged_attention(qview, kc, vc, qsl, seq_lens, bt, 0.1, out=out)
    assert_close(out[:T], ref_attention(q, kc, vc, qsl, seq_lens, bt, 0.1, 0), torch.bfloat16)
    assert torch.all(out[T:] == 7.0)


# bf16 prefill shapes that take the AVX512-BF16 tier's flash path (rows = queries x G >= 8,
# head dim and block size multiples of 16) as well as the per-row path (short items).
PREFILL_SEQS = {
    "one-prompt": ((300, 300),),
    # chunked prefill: 37 queries starting mid-sequence, a decode, a whole prompt
    "chunked-mixed": ((200, 37), (50, 1), (77, 77), (1, 1), (261, 45), (33, 33)),
}


@pytest.mark.parametrize("seqs", list(PREFILL_SEQS))
@pytest.mark.parametrize("bs", [16, 128])
@pytest.mark.parametrize(
    ("nh", "nkv", "hd"), [(16, 8, 128), (8, 1, 64), (6, 2, 80), (4, 4, 64), (4, 2, 256), (3, 1, 16)]
)
def test_paged_attention_bf16_prefill(kern, seqs, bs, nh, nkv, hd):
    scale = hd**-0.5
    case, ref = case_and_ref(PREFILL_SEQS[seqs], nh, nkv, hd, bs, torch.bfloat16, 5, scale, 0)
    assert_close(kern.paged_attention(*case, scale), ref, torch.bfloat16)


@pytest.mark.parametrize("window", [1, 17, 100])
@pytest.mark.parametrize("bs", [16, 128])
def test_paged_attention_bf16_prefill_sliding_window(kern, window, bs):
    seqs = PREFILL_SEQS["chunked-mixed"]
    case, ref = case_and_ref(seqs, 8, 2, 64, bs, torch.bfloat16, 6, 0.125, window)
    assert_close(kern.paged_attention(*case, 0.125, sliding_window=window), ref, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs", [16, 128])
@pytest.mark.parametrize("gqa", [1, 4])
def test_paged_attention_nan_in_unused_cache_slots(kern, dtype, bs, gqa):
    # Slots past each sequence's context and blocks no sequence owns hold NaN: they must
    # never reach the output (0 x NaN = NaN).  Decode items and long prefill items.
    seqs = (*PREFILL_SEQS["chunked-mixed"], (20, 20))
    nkv, hd = 2, 64
    nh = nkv * gqa
    q, kc, vc, qsl, seq_lens, bt = make_case(list(seqs), nh, nkv, hd, bs, dtype, seed=7)
    ref = ref_attention(q, kc, vc, qsl, seq_lens, bt, 0.125, 0)
    valid = torch.zeros(kc.shape[0], bs, dtype=torch.bool)
    for s, (ctx, _) in enumerate(seqs):
        for j in range(ctx):
            valid[bt[s, j // bs], j % bs] = True
    invalid = ~valid[:, None, :, None].expand_as(kc)
    kc, vc = kc.masked_fill(invalid, float("nan")), vc.masked_fill(invalid, float("nan"))
    out = kern.paged_attention(q, kc, vc, qsl, seq_lens, bt, 0.125)
    assert not out.isnan().any()
    assert_close(out, ref, dtype)


def test_paged_attention_rejects_bad_plan(kern):
    nkv, nh, hd, bs = 1, 1, 64, 16
    q, kc, vc, qsl, seq_lens, bt = make_case(SEQS, nh, nkv, hd, bs, torch.float32)
    bad = bt.clone()
    bad[3, 0] = kc.shape[0]  # block id beyond the cache
    with pytest.raises(ValueError, match="paged_attention"):
        kern.paged_attention(q, kc, vc, qsl, seq_lens, bad, 0.1)
    short = seq_lens.clone()
    short[1] = 2  # context shorter than this step's 7 query tokens
    with pytest.raises(ValueError, match="paged_attention"):
        kern.paged_attention(q, kc, vc, qsl, short, bt, 0.1)
    with pytest.raises(ValueError, match="int32"):
        kern.paged_attention(q, kc, vc, qsl.long(), seq_lens, bt, 0.1)
