"""Attention sinks (gpt-oss) in the native paged attention, every tier and path (decode rows,
the bf16 flash row groups, fp32, quantized caches), against a torch softmax with the sink
logit in the denominator: p_j = exp(s_j - m) / (exp(sink - m) + sum_i exp(s_i - m))."""

from __future__ import annotations

import math

import pytest
import torch
from test_attention import PREFILL_SEQS, SEQS, make_case
from tolerances import assert_close

from cpud.ranks.paged_kv import dequantize_kv, quantize_kv


def ref_sink_attention(q, kc, vc, qsl, seq_lens, bt, scale, window, sinks):
    """Dense reference: each head's scores joined by its sink logit, softmax, sink column
    dropped (no value row)."""
    T, nh, hd = q.shape
    nkv, bs = kc.shape[1], kc.shape[2]
    out = torch.zeros(T, nh, hd)
    for s in range(len(seq_lens)):
        ctx, t0, t1 = int(seq_lens[s]), int(qsl[s]), int(qsl[s + 1])
        blocks = bt[s, : math.ceil(ctx / bs)].long()
        k = kc[blocks].permute(1, 0, 2, 3).reshape(nkv, -1, hd)[:, :ctx].float()
        v = vc[blocks].permute(1, 0, 2, 3).reshape(nkv, -1, hd)[:, :ctx].float()
        k = k.repeat_interleave(nh // nkv, 0)
        v = v.repeat_interleave(nh // nkv, 0)
        scores = torch.einsum("thd,hjd->htj", q[t0:t1].float(), k) * scale
        pos = torch.arange(ctx - (t1 - t0), ctx)[:, None]
        j = torch.arange(ctx)[None, :]
        mask = j <= pos
        if window:
            mask &= j > pos - window
        scores = scores.masked_fill(~mask, float("-inf"))
        sink = sinks.float()[:, None, None].expand(nh, t1 - t0, 1)
        probs = torch.cat((scores, sink), -1).softmax(-1)[..., :-1]
        out[t0:t1] = torch.einsum("htj,hjd->thd", probs, v)
    return out


def _sinks(nh: int, seed: int) -> torch.Tensor:
    # around the scores' own range, so the sink takes a real share of each softmax
    return torch.randn(nh, generator=torch.Generator().manual_seed(seed)) * 2 + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("nh", "nkv", "hd", "bs"), [(8, 2, 64, 16), (4, 4, 80, 32), (3, 1, 33, 16)]
)
@pytest.mark.parametrize("window", [0, 9])
def test_sinks_decode_and_chunks(kern, dtype, nh, nkv, hd, bs, window):
    q, kc, vc, qsl, seq_lens, bt = make_case(SEQS, nh, nkv, hd, bs, dtype, seed=11)
    sinks = _sinks(nh, 1)
    scale = hd**-0.5
    out = kern.paged_attention(q, kc, vc, qsl, seq_lens, bt, scale, window, sinks=sinks)
    ref = ref_sink_attention(q, kc, vc, qsl, seq_lens, bt, scale, window, sinks)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize(("nh", "nkv", "hd"), [(16, 8, 128), (8, 1, 64), (6, 2, 80)])
def test_sinks_bf16_prefill_row_groups(kern, nh, nkv, hd):
    seqs = PREFILL_SEQS["chunked-mixed"]
    q, kc, vc, qsl, seq_lens, bt = make_case(list(seqs), nh, nkv, hd, 16, torch.bfloat16, 12)
    sinks = _sinks(nh, 2)
    out = kern.paged_attention(q, kc, vc, qsl, seq_lens, bt, 0.125, sinks=sinks)
    ref = ref_sink_attention(q, kc, vc, qsl, seq_lens, bt, 0.125, 0, sinks)
    assert_close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e5m2, torch.float8_e4m3fn])
def test_sinks_with_a_quantized_cache(kern, cache_dtype):
    seqs = PREFILL_SEQS["chunked-mixed"]
    q, kc, vc, qsl, seq_lens, bt = make_case(list(seqs), 8, 2, 64, 16, torch.bfloat16, 13)
    kq, vq = quantize_kv(kc, cache_dtype), quantize_kv(vc, cache_dtype)
    sinks = _sinks(8, 3)
    out = kern.paged_attention(q, kq, vq, qsl, seq_lens, bt, 0.125, sinks=sinks)
    kd, vd = dequantize_kv(kq, torch.bfloat16), dequantize_kv(vq, torch.bfloat16)
    ref = ref_sink_attention(q, kd, vd, qsl, seq_lens, bt, 0.125, 0, sinks)
    assert_close(out, ref, torch.bfloat16)


def test_sink_extremes(kern):
    q, kc, vc, qsl, seq_lens, bt = make_case(SEQS, 4, 2, 64, 16, torch.float32, seed=14)
    plain = kern.paged_attention(q, kc, vc, qsl, seq_lens, bt, 0.125)
    far_below = torch.full((4,), -1e4)
    low = kern.paged_attention(q, kc, vc, qsl, seq_lens, bt, 0.125, sinks=far_below)
    assert torch.equal(low, plain)  # exp(-1e4 - m) is 0: the plain softmax
    # a sink far above every score takes the whole softmax: outputs vanish, never NaN
    high = kern.paged_attention(q, kc, vc, qsl, seq_lens, bt, 0.125, sinks=torch.full((4,), 1e4))
    assert not high.isnan().any()
    assert high.abs().max() < 1e-30


def test_sinks_must_be_one_fp32_per_head(kern):
    q, kc, vc, qsl, seq_lens, bt = make_case(SEQS, 4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="sinks"):
        kern.paged_attention(q, kc, vc, qsl, seq_lens, bt, 0.1, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="sinks"):
        kern.paged_attention(q, kc, vc, qsl, seq_lens, bt, 0.1, sinks=torch.zeros(4).bfloat16())
