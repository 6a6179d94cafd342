/* Reading KV cache rows of any kv_formats.h type as f32, vectorised for the tier (included by
 * tier_kernels.h after the tier's simd_*.h).  A quantized value reads as its f32 value: int8
 * q * scale (one f32 product, not rounded to the activations' dtype: that rounding cost more
 * than the halved reads saved), e4m3 as e4m3 * scale the same way, e5m2 exactly. */

#include "kv_formats.h"

/* p: [VW] int8 -> f32 */
static ALWAYS_INLINE TGT vf kv_ld_i8(const int8_t *p) {
#if VW == 16
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif VW == 8
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    return (float)*p;
#endif
}

/* p: [VW] e5m2 bytes -> f32 (kv_e5m2_to_f32 per lane) */
static ALWAYS_INLINE TGT vf kv_ld_e5m2(const uint8_t *p) {
#if VW == 16
    const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i mag = _mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x7f)), 21);
    const __m512i sgn = _mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x80)), 24);
    const vf f = _mm512_mul_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(0x1p112f));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sgn));
#elif VW == 8
    const __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i mag = _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7f)), 21);
    const __m256i sgn = _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x80)), 24);
    const vf f = _mm256_mul_ps(_mm256_castsi256_ps(mag), _mm256_set1_ps(0x1p112f));
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(f), sgn));
#else
    return kv_e5m2_to_f32(*p);
#endif
}

/* p: [VW] e4m3fn bytes -> their values * 2^-8 (kv_e4m3_to_f32_q per lane): AVX-512 converts
 * the bytes' fp16 form, AVX2 (no F16C in its target) rebiases the exponent in integers. */
static ALWAYS_INLINE TGT vf kv_ld_e4m3q(const uint8_t *p) {
#if VW == 16
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i h =
        _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                        _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7));
    return _mm512_cvtph_ps(h);
#elif VW == 8
    const __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    const __m256i em = _mm256_and_si256(u, _mm256_set1_epi32(0x7f));
    /* exponent 0: (1 + m / 8) * 2^-14 - 2^-14 = m * 2^-17 */
    const __m256i tiny = _mm256_cmpgt_epi32(_mm256_set1_epi32(8), em);
    __m256i o = _mm256_add_epi32(_mm256_slli_epi32(em, 20), _mm256_set1_epi32(112 << 23));
    o = _mm256_add_epi32(o, _mm256_and_si256(tiny, _mm256_set1_epi32(1 << 23)));
    const __m256i bias = _mm256_and_si256(tiny, _mm256_set1_epi32(113 << 23)); /* 2^-14 */
    const vf mag = _mm256_sub_ps(_mm256_castsi256_ps(o), _mm256_castsi256_ps(bias));
    const __m256i sgn = _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x80)), 24);
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(mag), sgn));
#else
    return kv_e4m3_to_f32_q(*p);
#endif
}

/* Values [i, i + VW) of a quantized row (kvt int8 or e4m3 with d its kv_read_scale, or e5m2)
 * as f32. */
static ALWAYS_INLINE TGT vf kv_ldq(const char *row, int64_t i, int kvt, vf d) {
    if (kvt == CPUD_KV_INT8) return vf_mul(kv_ld_i8((const int8_t *)row + i), d);
    if (kvt == CPUD_KV_FP8_E4M3) return vf_mul(kv_ld_e4m3q((const uint8_t *)row + i), d);
    return kv_ld_e5m2((const uint8_t *)row + i);
}

/* Value i of a quantized row, as kv_ldq. */
static ALWAYS_INLINE float kv_ldq1(const char *row, int64_t i, int kvt, float d) {
    if (kvt == CPUD_KV_INT8) return (float)((const int8_t *)row)[i] * d;
    if (kvt == CPUD_KV_FP8_E4M3) return kv_e4m3_to_f32_q(((const uint8_t *)row)[i]) * d;
    return kv_e5m2_to_f32(((const uint8_t *)row)[i]);
}

/* Rows [a, b] (row j at row0 + j * rb, of kvt) -> dst: rows [a, b] of [.][hd] f32 (dt, the
 * activations' dtype, changes nothing: quantized values are not rounded to it). */
static ALWAYS_INLINE TGT void kv_rows_f32(const char *row0, int64_t rb, int kvt, int dt,
                                          int64_t a, int64_t b, int64_t hd, float *dst) {
    (void)dt;
    for (int64_t j = a; j <= b; j++) {
        const char *row = row0 + j * rb;
        float *o = dst + j * hd;
        if (!kv_quantized(kvt)) {
            to_f32(row, o, hd, 1.0f, kvt);
            continue;
        }
        const float d1 = kv_read_scale(row, hd, kvt);
        const vf d = vf_set1(d1);
        int64_t i = 0;
        for (; i + VW <= hd; i += VW) vf_st(o + i, kv_ldq(row, i, kvt, d));
        for (; i < hd; i++) o[i] = kv_ldq1(row, i, kvt, d1);
    }
}

/* kv_hadamard on rows [rows][hd] of f32 in place, the same bits: the passes of half-width
 * below VW inside each vector (lane i takes sign * v[i] + v[i ^ h], one rounding as u + w and
 * u - w), the wider ones between vectors. */
static TGT void hadamard_rows_k(float *x, int64_t rows, int64_t hd, int query) {
    const int64_t b = hd & -hd;
    if (VW == 1 || b < VW || hd % VW) {
        for (int64_t r = 0; r < rows; r++) kv_hadamard(x + r * hd, hd, query);
        return;
    }
#if VW > 1
    int m = 0;
    while ((INT64_C(1) << m) < b) m++;
    const vf s = vf_set1(ldexpf(1.0f, -(query ? (m + 1) / 2 : m / 2)));
    enum { PASSES = VW == 16 ? 4 : 3 };
    vf sign[PASSES];
#if VW == 16
    __m512i swap[PASSES];
#else
    __m256i swap[PASSES];
#endif
    for (int p = 0; p < PASSES; p++) {
        float sg[VW];
        int32_t ix[VW];
        for (int i = 0; i < VW; i++) {
            sg[i] = (i >> p) & 1 ? -1.0f : 1.0f;
            ix[i] = i ^ (1 << p);
        }
        sign[p] = vf_ld(sg);
#if VW == 16
        swap[p] = _mm512_loadu_si512(ix);
#else
        swap[p] = _mm256_loadu_si256((const __m256i *)ix);
#endif
    }
    for (int64_t r = 0; r < rows; r++) {
        float *y = x + r * hd;
        for (int64_t i = 0; i < hd; i += VW) {
            vf v = vf_ld(y + i);
            for (int p = 0; p < PASSES; p++) {
#if VW == 16
                v = vf_fma(v, sign[p], _mm512_permutexvar_ps(swap[p], v));
#else
                v = vf_fma(v, sign[p], _mm256_permutevar8x32_ps(v, swap[p]));
#endif
            }
            vf_st(y + i, v);
        }
        for (int64_t h = VW; h < b; h <<= 1)
            for (int64_t i = 0; i < hd; i += 2 * h)
                for (int64_t j = i; j < i + h; j += VW) {
                    const vf u = vf_ld(y + j), w = vf_ld(y + j + h);
                    vf_st(y + j, vf_add(u, w));
                    vf_st(y + j + h, vf_sub(u, w));
                }
        for (int64_t i = 0; i < hd; i += VW) vf_st(y + i, vf_mul(vf_ld(y + i), s));
    }
#endif
}
