/* Int8 primitives of the quantized GEMM, AVX-512 (F BW VL DQ): one 16-row operand per zmm.
 * Define QUANT_VNNI before including for vpdpbusd (AVX512-VNNI); else vpmaddubsw + vpmaddwd. */
#ifndef CPUD_QUANT_SIMD_H
#define CPUD_QUANT_SIMD_H

#include <immintrin.h>

#include "quant.h"

#ifdef QUANT_VNNI
#define QTGT __attribute__((target("avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#else
#define QTGT __attribute__((target("avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")))
#endif
#define QMR 4
#define Q8_OFF 128
#define QP 12

typedef __m512i qv; /* [16 rows][4] u8 */
typedef __m512i iv; /* [16] i32 */
typedef __m512 fv;  /* [16] f32 */

/* One load per vector: the barrier keeps the compiler from folding it into each of its uses
 * (a second load, where the load ports are the tightest resource at M = 1). */
static inline QTGT qv qv_ld(const uint8_t *p) {
    qv v = _mm512_load_si512((const void *)p);
    __asm__("" : "+v"(v));
    return v;
}
static inline QTGT qv qv_lo(qv v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0f)); }
static inline QTGT qv qv_hi(qv v) {
    return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f));
}
/* The high nibbles for iv_dot: with vpdpbusd, left in place (16 x the value, no shift; the
 * products fit its int32 sums) and taken out of the sum by iv_join_hi; else qv_hi. */
static inline QTGT qv qv_hi16(qv v) {
#ifdef QUANT_VNNI
    return _mm512_and_si512(v, _mm512_set1_epi8((char)0xf0));
#else
    return qv_hi(v);
#endif
}
static inline QTGT qv qv_or(qv a, qv b) { return _mm512_or_si512(a, b); }
/* ((h >> t) & 1) << 4 per byte, t in 0..7 */
static inline QTGT qv qv_b4(qv h, int t) {
    const qv s = t <= 4 ? _mm512_slli_epi16(h, 4 - t) : _mm512_srli_epi16(h, t - 4);
    return _mm512_and_si512(s, _mm512_set1_epi8(0x10));
}
/* ((h >> 2t) & 3) << 4 per byte, t in 0..3 */
static inline QTGT qv qv_b6(qv h, int t) {
    const qv s = t <= 2 ? _mm512_slli_epi16(h, 4 - 2 * t) : _mm512_srli_epi16(h, 2);
    return _mm512_and_si512(s, _mm512_set1_epi8(0x30));
}

/* E2M1 codes (0..15 per byte) -> their doubled values + E2M1_OFF */
static inline QTGT qv qv_e2m1(qv v) {
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_setr_epi8(E2M1_PLUS_OFF)), v);
}

static inline QTGT iv iv_zero(void) { return _mm512_setzero_si512(); }
static inline QTGT iv iv_add(iv a, iv b) { return _mm512_add_epi32(a, b); }
/* lo + hi of the dots of qv_lo and qv_hi16 quants (exact: hi's sum is 16 x an integer) */
static inline QTGT iv iv_join_hi(iv lo, iv hi) {
#ifdef QUANT_VNNI
    return _mm512_add_epi32(lo, _mm512_srai_epi32(hi, 4));
#else
    return _mm512_add_epi32(lo, hi);
#endif
}
static inline QTGT iv iv_subs(iv a, int32_t s) { return _mm512_sub_epi32(a, _mm512_set1_epi32(s)); }

/* acc + per row sum over i of w[row][i] * x4[i]; x4: [4] i8 */
static inline QTGT iv iv_dot(iv acc, qv w, const int8_t *x4) {
    int32_t x;
    memcpy(&x, x4, sizeof x);
#ifdef QUANT_VNNI
    return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x));
#else
    const __m512i p = _mm512_maddubs_epi16(w, _mm512_set1_epi32(x));
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
#endif
}

/* iv_dot for w up to 255 (Q8_0 quants are stored + 128): maddubs would saturate, so it
 * takes w = lo + 128 hi apart. */
static inline QTGT iv iv_dot8(iv acc, qv w, const int8_t *x4) {
#ifdef QUANT_VNNI
    return iv_dot(acc, w, x4);
#else
    const qv lo = _mm512_and_si512(w, _mm512_set1_epi8(0x7f));
    const qv hi = _mm512_and_si512(_mm512_srli_epi16(w, 7), _mm512_set1_epi8(0x01));
    const iv a = iv_dot(acc, lo, x4);
    return _mm512_add_epi32(a, _mm512_slli_epi32(iv_dot(iv_zero(), hi, x4), 7));
#endif
}

static inline QTGT fv fv_zero(void) { return _mm512_setzero_ps(); }
static inline QTGT fv fv_set1(float a) { return _mm512_set1_ps(a); }
static inline QTGT fv fv_cvt(iv a) { return _mm512_cvtepi32_ps(a); }
static inline QTGT fv fv_mul(fv a, fv b) { return _mm512_mul_ps(a, b); }
static inline QTGT fv fv_add(fv a, fv b) { return _mm512_add_ps(a, b); }
static inline QTGT fv fv_fma(fv a, fv b, fv c) { return _mm512_fmadd_ps(a, b, c); }
static inline QTGT fv fv_fnma(fv a, fv b, fv c) { return _mm512_fnmadd_ps(a, b, c); }
/* p: [16] fp16 */
static inline QTGT fv fv_h16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
/* p: [16] u8 */
static inline QTGT fv fv_u8(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* p: [16] i8 */
static inline QTGT fv fv_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* p: [16] E8M0 bytes -> 2^(e - 128), as e8m0_half */
static inline QTGT fv fv_e8m0(const uint8_t *p) {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i big = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i small = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    const __mmask16 below2 = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(below2, big, small));
}
/* p: [16] E8M0 bytes -> what fv_e8m0_times takes: e - 128 */
static inline QTGT fv fv_e8m0_pre(const uint8_t *p) {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(e, _mm512_set1_epi32(128)));
}
/* fv_mul(fv_e8m0(p), a) for e = fv_e8m0_pre(p): a 2^(e - 128) rounded once, as that product */
static inline QTGT fv fv_e8m0_times(fv e, fv a) { return _mm512_scalef_ps(a, e); }
/* p: [16] */
static inline QTGT void fv_st(float *p, fv a) { _mm512_storeu_ps(p, a); }

/* p: [16] of dt */
static inline QTGT __m512 ld16(const void *p, int dt) {
    if (dt == CPUD_F32) return _mm512_loadu_ps(p);
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* x: [K] of dt -> q [K] i8, d [K/32], s [K/16] */
static inline QTGT void q_quant_row(const void *x, int dt, int64_t K, int8_t *q, float *d,
                                    int32_t *s) {
    const int es = dtype_size(dt);
    for (int64_t b = 0; b < K / 32; b++) {
        const __m512 v0 = ld16((const char *)x + b * 32 * es, dt);
        const __m512 v1 = ld16((const char *)x + (b * 32 + 16) * es, dt);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id));
        const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
        d[b] = amax / 127.0f;
        s[2 * b] = _mm512_reduce_add_epi32(i0);
        s[2 * b + 1] = _mm512_reduce_add_epi32(i1);
        _mm_storeu_si128((__m128i *)(q + b * 32), _mm512_cvtepi32_epi8(i0));
        _mm_storeu_si128((__m128i *)(q + b * 32 + 16), _mm512_cvtepi32_epi8(i1));
    }
}

/* QP independent iv_dot chains, iters times; returns the multiply-adds done. */
static inline QTGT double q_probe(int64_t iters, float *sink) {
    iv acc[QP];
    qv w = _mm512_set1_epi8(3);
    const int8_t x4[4] = {1, -2, 3, -4};
    for (int i = 0; i < QP; i++) acc[i] = iv_zero();
    for (int64_t it = 0; it < iters; it++) {
        __asm__("" : "+v"(w));
        for (int i = 0; i < QP; i++) acc[i] = iv_dot(acc[i], w, x4);
    }
    iv t = acc[0];
    for (int i = 1; i < QP; i++) t = _mm512_add_epi32(t, acc[i]);
    *sink += (float)_mm512_reduce_add_epi32(t);
    return (double)iters * QP * 64;
}

#endif
