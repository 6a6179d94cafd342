"""Quantized KV caches (--kv-cache-dtype int8 / fp8_e5m2 / fp8_e4m3, and bf16 under fp32
activations):
the KV write kernel against the torch quantizer of ranks/paged_kv.py byte for byte (plain and
Hadamard-rotated rows), and paged attention (decode, chunked prefill, GQA, odd head dims, block
boundaries) on every tier against the same kernel and the torch reference on the dequantized
cache; a rotated cache's attention against the plain kernel run in the rotated basis."""

from __future__ import annotations

import pytest
import torch
from test_attention import make_case, ref_attention
from tolerances import assert_close

from cpud.ranks.paged_kv import dequantize_kv, hadamard, kv_cache_shape, quantize_kv

QUANTIZED = [torch.int8, torch.float8_e5m2, torch.float8_e4m3fn]
SCALED = (torch.int8, torch.float8_e4m3fn)  # rows that end in an f32 scale
# contexts around block edges (16, 17, 32, 33) for decode and chunks, a long prefill chunk
SEQS = ((16, 1), (17, 17), (33, 1), (32, 5), (130, 40), (1, 1))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


# (activations, cache): every quantized cache under both, and bf16 rows under fp32 activations
WRITES = [(a, c) for a in (torch.float32, torch.bfloat16) for c in QUANTIZED]
WRITES.append((torch.float32, torch.bfloat16))


@pytest.mark.parametrize(("dtype", "cache_dtype"), WRITES)
@pytest.mark.parametrize("rotated", [True, False])
@pytest.mark.parametrize("hd", [64, 33, 128, 80])  # Hadamard blocks of 64, 1 (none), 128, 16
def test_write_kv_cache_matches_the_torch_quantizer(kern, dtype, cache_dtype, hd, rotated):
    g = torch.Generator().manual_seed(1)
    T, nkv, nb, bs = 6, 2, 4, 16
    key = (torch.randn(T, nkv, hd, generator=g) * 3).to(dtype)
    value = torch.randn(T, nkv, hd, generator=g).to(dtype)
    key[0, 0] = 0.0  # an all-zero row: scale 0
    key[1, 0, :4] = torch.tensor([1e-6, 7e4, -1e5, -3e-8]).to(dtype)  # e5m2: subnormal, saturated
    value[2, 1, 0] = 1000.0  # one outlier sets the row's scale (e4m3: the rest subnormal)
    value[3, 0] *= 1e-38  # e4m3: a subnormal f32 scale
    kc = torch.zeros(kv_cache_shape(nb, nkv, bs, hd, cache_dtype), dtype=cache_dtype)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([0, 5, 17, 40, -1, 63])
    kern.write_kv_cache(key, value, kc, vc, slots, rotated=rotated)
    keep = slots >= 0
    blocks, offsets = slots[keep] // bs, slots[keep] % bs
    for cache, src in ((kc, key), (vc, value)):
        got = cache[blocks, :, offsets]
        want = quantize_kv(src[keep], cache_dtype, rotated)
        assert torch.equal(_as_bytes(got), _as_bytes(want))
    assert torch.count_nonzero(_as_bytes(kc)) > 0


@pytest.mark.parametrize("rotated", [False, True])
def test_quantized_rows_read_back_close(rotated):
    # each format's rounding bound on the values it stores: x, or x rotated
    x = torch.randn(64, 128) * torch.linspace(0.1, 10, 64)[:, None]
    y = hadamard(x, query=False) if rotated else x

    def stored(cache_dtype: torch.dtype) -> torch.Tensor:
        return dequantize_kv(quantize_kv(x, cache_dtype, rotated), torch.float32, rotated=False)

    int8 = stored(torch.int8)
    assert ((int8 - y).abs() <= y.abs().amax(-1, keepdim=True) / 254 * 1.0001).all()
    fp8 = stored(torch.float8_e5m2)
    assert ((fp8 - y).abs() <= y.abs() / 8 + 1e-5).all()  # 2 mantissa bits: half-ulp 1/8
    e4m3 = stored(torch.float8_e4m3fn)
    # 3 mantissa bits: half-ulp 1/16, and below 2^-6 of the scale a fixed step 2^-10 of it
    bound = y.abs() / 16 + y.abs().amax(-1, keepdim=True) / 448 * 2**-10
    assert ((e4m3 - y).abs() <= bound * 1.0001).all()


@pytest.mark.parametrize("hd", [64, 128, 80, 48, 33])
def test_the_rotation_keeps_scores_and_undoes_itself(hd):
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 40, hd, generator=g)
    rows = hadamard(k, query=False)
    assert torch.allclose(hadamard(rows, query=True), k, atol=1e-5)
    scores = (hadamard(q, query=True) * rows).sum(-1)
    assert torch.allclose(scores, (q * k).sum(-1), atol=1e-4)
    if hd & -hd > 1:  # a real rotation: one channel spreads over its whole block
        spike = torch.zeros(hd)
        spike[0] = 1.0
        assert torch.count_nonzero(hadamard(spike, query=False)) == hd & -hd


# Queries and keys as a model's: a few channels far larger than the rest, the same in both
# (where the rotation pays: the large products spread over the row; with isotropic queries
# e4m3 loses more rotated, and the default model's NLL says which case is real)
def outlier_rows(n: int, hd: int, seed: int, factor: float) -> torch.Tensor:
    rows = torch.randn(n, hd, generator=torch.Generator().manual_seed(seed))
    rows[:, [3, 17]] *= factor
    return rows


@pytest.mark.parametrize("cache_dtype", QUANTIZED)
def test_rotated_rows_lose_less_of_the_scores(cache_dtype):
    q, k = outlier_rows(256, 64, 7, 10.0), outlier_rows(256, 64, 6, 40.0)
    exact = (q * k).sum(-1)
    err = {}
    for rotated in (False, True):
        read = dequantize_kv(quantize_kv(k, cache_dtype, rotated), torch.float32, rotated)
        err[rotated] = ((q * read).sum(-1) - exact).norm() / exact.norm()
    assert err[True] < 0.5 * err[False], err


def int8_reads_unrounded(dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """An int8 or e4m3 cache under bf16 activations is read as q * scale in f32 (not rounded
    to bf16), and the bf16 flash tiers decode int8 in integers (tier_flash_int8.h: queries
    rounded to int8, probabilities to u8) and e4m3 with the scales folded into the score and
    the probability (tier_flash_e4m3.h): close to a cache of the dequantized values, not
    bit-equal."""
    return dtype == torch.bfloat16 and cache_dtype in SCALED


def _quantized_case(nh, nkv, hd, bs, dtype, cache_dtype, seed=0, rotated=True):
    q, kc, vc, qsl, seq_lens, bt = make_case(list(SEQS), nh, nkv, hd, bs, dtype, seed)
    kq, vq = quantize_kv(kc, cache_dtype, rotated), quantize_kv(vc, cache_dtype, rotated)
    return q, kq, vq, qsl, seq_lens, bt


SHAPES = [(8, 2, 64, 16), (16, 2, 128, 32), (4, 4, 80, 16), (6, 2, 24, 16), (3, 1, 33, 16)]
# 6 and 3 query rows per kv head, hd 48 part-filling a 64-byte vector (the bf16 tiers' integer
# int8 decode: row blocks of 4 + 2 and of 3, masked lanes)
INT8_DECODE_SHAPES = [(12, 2, 48, 16), (9, 3, 64, 16)]
# e4m3 reads as int8 does but for the value conversion: the flash path (hd 64, 80) and the
# tiers' vector and scalar tails (hd 33); the bf16 flash tiers' e4m3 decode in registers on
# 1, 3, 4, 6 (part-filled 64-byte vectors: hd 48), 8 and 12 (run as 16) rows per kv head
E4M3_SHAPES = [(8, 2, 64, 16), (4, 4, 80, 16), (3, 1, 33, 16), (16, 2, 128, 32), (12, 1, 64, 16)]
E4M3_SHAPES += INT8_DECODE_SHAPES
READS = [(torch.int8, *s) for s in SHAPES + INT8_DECODE_SHAPES]
READS += [(torch.float8_e5m2, *s) for s in SHAPES + INT8_DECODE_SHAPES]
READS += [(torch.float8_e4m3fn, *s) for s in E4M3_SHAPES]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("cache_dtype", "nh", "nkv", "hd", "bs"), READS)
def test_paged_attention_reads_quantized_caches(kern, dtype, cache_dtype, nh, nkv, hd, bs):
    # plain rows: the values each format reads as
    plain = _quantized_case(nh, nkv, hd, bs, dtype, cache_dtype, rotated=False)
    q, kq, vq, qsl, seq_lens, bt = plain
    kd, vd = dequantize_kv(kq, dtype, False), dequantize_kv(vq, dtype, False)
    scale = hd**-0.5
    out = kern.paged_attention(q, kq, vq, qsl, seq_lens, bt, scale, rotated=False)
    same_values = kern.paged_attention(q, kd, vd, qsl, seq_lens, bt, scale)
    if int8_reads_unrounded(dtype, cache_dtype):
        assert_close(out, same_values, dtype)
    else:  # the same bits as a dtype cache holding the values the quantized one reads as
        assert torch.equal(out, same_values)
    assert_close(out, ref_attention(q, kd, vd, qsl, seq_lens, bt, scale, 0), dtype)

    # rotated rows (cpud's caches): attention in the model's basis
    q, kq, vq, qsl, seq_lens, bt = _quantized_case(nh, nkv, hd, bs, dtype, cache_dtype)
    kd, vd = dequantize_kv(kq, dtype), dequantize_kv(vq, dtype)
    out = kern.paged_attention(q, kq, vq, qsl, seq_lens, bt, scale)
    assert_close(out, ref_attention(q, kd, vd, qsl, seq_lens, bt, scale, 0), dtype)
    # the plain kernel on the rotated queries, its output rotated back: the same bits in fp32
    # (the kernel normalises, then rotates, as hadamard does), one more rounding in bf16
    q_rot = hadamard(q, query=True).to(dtype)
    in_basis = kern.paged_attention(q_rot, kq, vq, qsl, seq_lens, bt, scale, rotated=False)
    back = hadamard(in_basis, query=True).to(dtype)
    if dtype == torch.float32:
        assert torch.equal(out, back)
    else:
        assert_close(out, back, dtype)


@pytest.mark.parametrize("cache_dtype", QUANTIZED)
def test_paged_attention_quantized_sliding_window(kern, cache_dtype):
    q, kq, vq, qsl, seq_lens, bt = _quantized_case(8, 2, 64, 16, torch.bfloat16, cache_dtype, 2)
    kd, vd = dequantize_kv(kq, torch.bfloat16), dequantize_kv(vq, torch.bfloat16)
    out = kern.paged_attention(q, kq, vq, qsl, seq_lens, bt, 0.125, sliding_window=20)
    ref = ref_attention(q, kd, vd, qsl, seq_lens, bt, 0.125, 20)
    assert_close(out, ref, torch.bfloat16)


def test_paged_attention_bf16_cache_under_fp32(kern):
    q, kc, vc, qsl, seq_lens, bt = make_case(list(SEQS), 8, 2, 64, 16, torch.float32)
    kb, vb = kc.bfloat16(), vc.bfloat16()
    out = kern.paged_attention(q, kb, vb, qsl, seq_lens, bt, 0.125)
    assert out.dtype == torch.float32
    assert torch.equal(
        out, kern.paged_attention(q, kb.float(), vb.float(), qsl, seq_lens, bt, 0.125)
    )


@pytest.mark.parametrize("cache_dtype", QUANTIZED)
def test_quantized_attention_stays_close_to_bf16(kern, cache_dtype):
    # the quantization error itself: int8 / e5m2 caches against the unquantized bf16 cache
    q, kc, vc, qsl, seq_lens, bt = make_case(list(SEQS), 8, 2, 64, 16, torch.bfloat16, 3)
    exact = kern.paged_attention(q, kc, vc, qsl, seq_lens, bt, 0.125).float()
    kq, vq = quantize_kv(kc, cache_dtype), quantize_kv(vc, cache_dtype)
    out = kern.paged_attention(q, kq, vq, qsl, seq_lens, bt, 0.125).float()
    err = (out - exact).norm() / exact.norm()
    assert err < {torch.int8: 0.02, torch.float8_e4m3fn: 0.05}.get(cache_dtype, 0.12)


@pytest.mark.parametrize("cache_dtype", QUANTIZED)
@pytest.mark.parametrize("bs", [16, 128])
def test_quantized_garbage_in_unused_slots_never_reaches_the_output(kern, cache_dtype, bs):
    # Unused rows of every byte 0xff: int8 / e4m3 scale NaN, e5m2 / e4m3 NaN patterns.
    seqs = ((200, 37), (50, 1), (77, 77), (20, 20))
    q, kc, vc, qsl, seq_lens, bt = make_case(list(seqs), 8, 2, 64, bs, torch.bfloat16, 7)
    kq, vq = quantize_kv(kc, cache_dtype), quantize_kv(vc, cache_dtype)
    clean = kern.paged_attention(q, kq, vq, qsl, seq_lens, bt, 0.125)
    valid = torch.zeros(kc.shape[0], bs, dtype=torch.bool)
    for s, (ctx, _) in enumerate(seqs):
        for j in range(ctx):
            valid[bt[s, j // bs], j % bs] = True
    for cache in (kq, vq):
        _as_bytes(cache)[~valid[:, None, :, None].expand_as(cache)] = 0xFF
    out = kern.paged_attention(q, kq, vq, qsl, seq_lens, bt, 0.125)
    assert torch.equal(out, clean)


def test_paged_attention_rejects_caches_it_cannot_read(kern):
    q, kc, vc, qsl, seq_lens, bt = make_case(list(SEQS), 2, 1, 64, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="key_cache"):
        kern.paged_attention(q, kc.float(), vc.float(), qsl, seq_lens, bt, 0.1)
    int8_without_scales = kc.to(torch.int8)
    with pytest.raises(ValueError, match="key_cache"):
        kern.paged_attention(q, int8_without_scales, int8_without_scales, qsl, seq_lens, bt, 0.1)


# every finite e5m2 byte; and only exponents 0 and 1 (zeros, subnormals, the smallest normals),
# with a score scale that makes them count
E5M2_CODES = {
    "finite": ([c for c in range(256) if c & 0x7C != 0x7C], 1e-4),
    "tiny": ([c for c in range(256) if c & 0x78 == 0], 1e8),
}


@pytest.mark.parametrize("hd", [64, 80])
@pytest.mark.parametrize("codes", list(E5M2_CODES))
def test_every_e5m2_code_reads_as_torch_reads_it(kern, hd, codes):
    # attention on e5m2 bytes equals attention on the values torch's float8_e5m2 gives them
    q, kc, vc, qsl, seq_lens, bt = make_case(list(SEQS), 4, 2, hd, 16, torch.bfloat16, 9)
    pool, scale = E5M2_CODES[codes]
    pool = torch.tensor(pool, dtype=torch.uint8)
    g = torch.Generator().manual_seed(9)
    kq, vq = (pool[torch.randint(len(pool), kc.shape, generator=g)] for _ in range(2))
    kq, vq = kq.view(torch.float8_e5m2), vq.view(torch.float8_e5m2)
    kd, vd = kq.to(torch.bfloat16), vq.to(torch.bfloat16)
    assert kd.isfinite().all()
    out = kern.paged_attention(q, kq, vq, qsl, seq_lens, bt, scale, rotated=False)
    assert torch.equal(out, kern.paged_attention(q, kd, vd, qsl, seq_lens, bt, scale))
    assert out.abs().max() > 0


@pytest.mark.parametrize("hd", [64, 80])
def test_every_e4m3_code_reads_as_torch_reads_it(kern, hd):
    # fp32 attention on e4m3 rows (every byte but the NaN patterns, and scales from subnormal
    # to huge) equals attention on the values torch's float8_e4m3fn times the scale gives them;
    # so does bf16 attention on the flash tiers: prefill rounds the values to bf16, and decode
    # (tier_flash_e4m3.h: every code through its bf16 conversion) multiplies the codes by
    # power-of-two scales under a flat softmax, where every product is exact
    q, kc, vc, qsl, seq_lens, bt = make_case(list(SEQS), 4, 2, hd, 16, torch.float32, 11)
    pool = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    g = torch.Generator().manual_seed(11)
    caches = []
    for _ in range(2):
        codes = pool[torch.randint(len(pool), (*kc.shape[:-1], hd), generator=g)]
        exponent = torch.randint(-140, 100, (*kc.shape[:-1], 1), generator=g)
        scale = torch.ldexp(torch.ones(exponent.shape), exponent.float())
        caches.append(torch.cat((codes, scale.view(torch.uint8)), -1).view(torch.float8_e4m3fn))
    kq, vq = caches
    flash = kern.isa in ("avx512bf16", "amx")
    for dtype in (torch.float32, torch.bfloat16) if flash else (torch.float32,):
        kd, vd = dequantize_kv(kq, dtype, False), dequantize_kv(vq, dtype, False)
        assert kd.isfinite().all()
        qd = q.to(dtype)
        out = kern.paged_attention(qd, kq, vq, qsl, seq_lens, bt, 1e-30, rotated=False)
        assert torch.equal(out, kern.paged_attention(qd, kd, vd, qsl, seq_lens, bt, 1e-30))
        assert out.abs().max() > 0
