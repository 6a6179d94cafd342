/* Vector abstraction, AVX2 + FMA tier: 8 floats per vector. */
#ifndef CPUD_SIMD_H
#define CPUD_SIMD_H

#include <immintrin.h>

#include "common.h"

#define TGT __attribute__((target("avx,avx2,fma")))
#define VW 8
#define TIER_ID 1
typedef __m256 vf;

static inline TGT vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline TGT vf vf_set1(float a) { return _mm256_set1_ps(a); }
static inline TGT vf vf_ld(const float *p) { return _mm256_loadu_ps(p); }
static inline TGT void vf_st(float *p, vf v) { _mm256_storeu_ps(p, v); }

/* p: [8] bf16 */
static inline TGT vf vf_ld_bf16(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* fp32 bit patterns rounded to nearest even at bit 16 (low half garbage). */
static inline TGT __m256i vf_rne_bits(vf v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r),
                                                _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)),
                                                nan));
}

/* p: [8] bf16 */
static inline TGT void vf_st_bf16(uint16_t *p, vf v) {
    __m256i r = _mm256_srli_epi32(vf_rne_bits(v), 16);
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128((__m128i *)p, packed);
}

static inline TGT vf vf_rnd_bf16(vf v) {
    return _mm256_castsi256_ps(_mm256_and_si256(vf_rne_bits(v), _mm256_set1_epi32((int)0xffff0000)));
}

static inline TGT vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline TGT vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline TGT vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline TGT vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline TGT vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline TGT vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline TGT vf vf_swap_pairs(vf a) { return _mm256_permute_ps(a, 0xB1); }

static inline TGT float vf_hsum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline TGT float vf_hmax(vf a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Cephes-style expf: |rel err| ~ 2 ulp on [-87, 88]; clamps outside. */
static inline TGT vf vf_exp(vf x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#endif
