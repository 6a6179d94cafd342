/* Int8 primitives of the quantized GEMM, AVX2: one 16-row operand as two ymm (rows 0-7, 8-15).
 * Define QUANT_VNNI before including for AVX-VNNI vpdpbusd; else vpmaddubsw + vpmaddwd. */
#ifndef CPUD_QUANT_SIMD_H
#define CPUD_QUANT_SIMD_H

#include <immintrin.h>

#include "quant.h"

#ifdef QUANT_VNNI
#define QTGT __attribute__((target("avx,avx2,fma,f16c,avxvnni")))
#else
#define QTGT __attribute__((target("avx,avx2,fma,f16c")))
#endif
#define QMR 2
#define Q8_OFF 128
#define QP 6

typedef struct { __m256i a, b; } qv; /* [16 rows][4] u8 */
typedef struct { __m256i a, b; } iv; /* [16] i32 */
typedef struct { __m256 a, b; } fv;  /* [16] f32 */

#define QV2(op, x, y) ((qv){op((x).a, (y).a), op((x).b, (y).b)})

static inline QTGT qv qv_ld(const uint8_t *p) {
    return (qv){_mm256_load_si256((const __m256i *)p), _mm256_load_si256((const __m256i *)(p + 32))};
}
static inline QTGT qv qv_and8(qv v, char m) {
    const __m256i k = _mm256_set1_epi8(m);
    return (qv){_mm256_and_si256(v.a, k), _mm256_and_si256(v.b, k)};
}
static inline QTGT qv qv_lo(qv v) { return qv_and8(v, 0x0f); }
static inline QTGT qv qv_hi(qv v) {
    return qv_and8((qv){_mm256_srli_epi16(v.a, 4), _mm256_srli_epi16(v.b, 4)}, 0x0f);
}
/* As quant_simd_avx512.h's: 16 x the high nibble in place with vpdpbusd, else qv_hi. */
static inline QTGT qv qv_hi16(qv v) {
#ifdef QUANT_VNNI
    return qv_and8(v, (char)0xf0);
#else
    return qv_hi(v);
#endif
}
static inline QTGT qv qv_or(qv x, qv y) { return QV2(_mm256_or_si256, x, y); }
/* ((h >> s) as 16-bit words, s < 0: left) */
static inline QTGT qv qv_shift(qv h, int s) {
    if (s >= 0) return (qv){_mm256_srli_epi16(h.a, s), _mm256_srli_epi16(h.b, s)};
    return (qv){_mm256_slli_epi16(h.a, -s), _mm256_slli_epi16(h.b, -s)};
}
/* ((h >> t) & 1) << 4 per byte, t in 0..7 */
static inline QTGT qv qv_b4(qv h, int t) { return qv_and8(qv_shift(h, t - 4), 0x10); }
/* ((h >> 2t) & 3) << 4 per byte, t in 0..3 */
static inline QTGT qv qv_b6(qv h, int t) { return qv_and8(qv_shift(h, 2 * t - 4), 0x30); }

/* E2M1 codes (0..15 per byte) -> their doubled values + E2M1_OFF */
static inline QTGT qv qv_e2m1(qv v) {
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_setr_epi8(E2M1_PLUS_OFF));
    return (qv){_mm256_shuffle_epi8(lut, v.a), _mm256_shuffle_epi8(lut, v.b)};
}

static inline QTGT iv iv_zero(void) { return (iv){_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline QTGT iv iv_add(iv a, iv b) {
    return (iv){_mm256_add_epi32(a.a, b.a), _mm256_add_epi32(a.b, b.b)};
}
static inline QTGT iv iv_join_hi(iv lo, iv hi) {
#ifdef QUANT_VNNI
    return (iv){_mm256_add_epi32(lo.a, _mm256_srai_epi32(hi.a, 4)),
                _mm256_add_epi32(lo.b, _mm256_srai_epi32(hi.b, 4))};
#else
    return iv_add(lo, hi);
#endif
}
static inline QTGT iv iv_subs(iv v, int32_t s) {
    const __m256i k = _mm256_set1_epi32(s);
    return (iv){_mm256_sub_epi32(v.a, k), _mm256_sub_epi32(v.b, k)};
}

static inline QTGT __m256i dot8(__m256i acc, __m256i w, __m256i x) {
#ifdef QUANT_VNNI
    return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
    return _mm256_add_epi32(acc, p);
#endif
}

/* acc + per row sum over i of w[row][i] * x4[i]; x4: [4] i8 */
static inline QTGT iv iv_dot(iv acc, qv w, const int8_t *x4) {
    int32_t x;
    memcpy(&x, x4, sizeof x);
    const __m256i xb = _mm256_set1_epi32(x);
    return (iv){dot8(acc.a, w.a, xb), dot8(acc.b, w.b, xb)};
}

/* iv_dot for w up to 255 (Q8_0 quants are stored + 128): maddubs would saturate, so it
 * takes w = lo + 128 hi apart. */
static inline QTGT iv iv_dot8(iv acc, qv w, const int8_t *x4) {
#ifdef QUANT_VNNI
    return iv_dot(acc, w, x4);
#else
    const iv a = iv_dot(acc, qv_and8(w, 0x7f), x4);
    const iv h = iv_dot(iv_zero(), qv_and8(qv_shift(w, 7), 0x01), x4);
    return (iv){_mm256_add_epi32(a.a, _mm256_slli_epi32(h.a, 7)),
                _mm256_add_epi32(a.b, _mm256_slli_epi32(h.b, 7))};
#endif
}

static inline QTGT fv fv_zero(void) { return (fv){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline QTGT fv fv_set1(float s) { return (fv){_mm256_set1_ps(s), _mm256_set1_ps(s)}; }
static inline QTGT fv fv_cvt(iv v) { return (fv){_mm256_cvtepi32_ps(v.a), _mm256_cvtepi32_ps(v.b)}; }
static inline QTGT fv fv_mul(fv x, fv y) {
    return (fv){_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)};
}
static inline QTGT fv fv_add(fv x, fv y) {
    return (fv){_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)};
}
static inline QTGT fv fv_fma(fv x, fv y, fv z) {
    return (fv){_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)};
}
static inline QTGT fv fv_fnma(fv x, fv y, fv z) {
    return (fv){_mm256_fnmadd_ps(x.a, y.a, z.a), _mm256_fnmadd_ps(x.b, y.b, z.b)};
}
/* p: [16] fp16 */
static inline QTGT fv fv_h16(const uint16_t *p) {
    return (fv){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)))};
}
/* p: [16] u8 */
static inline QTGT fv fv_u8(const uint8_t *p) {
    return (fv){_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p))),
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))))};
}
/* p: [16] i8 */
static inline QTGT fv fv_i8(const int8_t *p) {
    return (fv){_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))),
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))))};
}
/* p: [8] E8M0 bytes -> 2^(e - 128), as e8m0_half */
static inline QTGT __m256 e8m0_8(const uint8_t *p) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i big = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i small = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const __m256i below2 = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(big, small, below2));
}
/* p: [16] E8M0 bytes -> 2^(e - 128) */
static inline QTGT fv fv_e8m0(const uint8_t *p) { return (fv){e8m0_8(p), e8m0_8(p + 8)}; }
/* p: [16] E8M0 bytes -> what fv_e8m0_times takes (here their scales themselves) */
static inline QTGT fv fv_e8m0_pre(const uint8_t *p) { return fv_e8m0(p); }
/* fv_mul(fv_e8m0(p), a) for e = fv_e8m0_pre(p) */
static inline QTGT fv fv_e8m0_times(fv e, fv a) { return fv_mul(e, a); }
/* p: [16] */
static inline QTGT void fv_st(float *p, fv v) {
    _mm256_storeu_ps(p, v.a);
    _mm256_storeu_ps(p + 8, v.b);
}

/* p: [8] of dt */
static inline QTGT __m256 ld8(const void *p, int dt) {
    if (dt == CPUD_F32) return _mm256_loadu_ps(p);
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline QTGT int32_t hsum8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

static inline QTGT float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* x: [K] of dt -> q [K] i8, d [K/32], s [K/16] */
static inline QTGT void q_quant_row(const void *x, int dt, int64_t K, int8_t *q, float *d,
                                    int32_t *s) {
    const int es = dtype_size(dt);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < K / 32; b++) {
        __m256 v[4], m = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = ld8((const char *)x + (b * 32 + 8 * j) * es, dt);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
        }
        const float amax = hmax8(m);
        const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m256i i[4];
        for (int j = 0; j < 4; j++) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));
        d[b] = amax / 127.0f;
        s[2 * b] = hsum8(_mm256_add_epi32(i[0], i[1]));
        s[2 * b + 1] = hsum8(_mm256_add_epi32(i[2], i[3]));
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
        const __m256i o = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + b * 32), o);
    }
}

/* QP independent iv_dot chains, iters times; returns the multiply-adds done. */
static inline QTGT double q_probe(int64_t iters, float *sink) {
    iv acc[QP];
    qv w = {_mm256_set1_epi8(3), _mm256_set1_epi8(5)};
    const int8_t x4[4] = {1, -2, 3, -4};
    for (int i = 0; i < QP; i++) acc[i] = iv_zero();
    for (int64_t it = 0; it < iters; it++) {
        __asm__("" : "+x"(w.a), "+x"(w.b));
        for (int i = 0; i < QP; i++) acc[i] = iv_dot(acc[i], w, x4);
    }
    __m256i t = _mm256_setzero_si256();
    for (int i = 0; i < QP; i++) t = _mm256_add_epi32(t, _mm256_add_epi32(acc[i].a, acc[i].b));
    *sink += (float)hsum8(t);
    return (double)iters * QP * 64;
}

#endif
