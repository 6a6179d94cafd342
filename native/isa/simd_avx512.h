/* Vector abstraction, AVX-512 tiers: 16 floats per vector.  Define
 * CPUD_WITH_BF16 before including for the AVX512-BF16 tier, and CPUD_WITH_AMX too for the
 * AMX tier (the same kernels, GEMMs on AMX tiles). */
#ifndef CPUD_SIMD_H
#define CPUD_SIMD_H

#include <immintrin.h>

#include "common.h"

#if defined(CPUD_WITH_AMX)
#define TGT                                                                                        \
    __attribute__((target("avx,avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,"  \
                          "amx-bf16")))
#define TIER_ID 4
#elif defined(CPUD_WITH_BF16)
#define TGT __attribute__((target("avx,avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define TIER_ID 3
#else
#define TGT __attribute__((target("avx,avx2,fma,avx512f,avx512bw,avx512vl,avx512dq")))
#define TIER_ID 2
#endif
#define VW 16
typedef __m512 vf;

static inline TGT vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline TGT vf vf_set1(float a) { return _mm512_set1_ps(a); }
static inline TGT vf vf_ld(const float *p) { return _mm512_loadu_ps(p); }
static inline TGT void vf_st(float *p, vf v) { _mm512_storeu_ps(p, v); }

/* p: [16] bf16 */
static inline TGT vf vf_ld_bf16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* fp32 bit patterns rounded to nearest even at bit 16 (low half garbage). */
static inline TGT __m512i vf_rne_bits(vf v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000));
}

/* p: [16] bf16 */
static inline TGT void vf_st_bf16(uint16_t *p, vf v) {
#ifdef CPUD_WITH_BF16
    __m256bh h = _mm512_cvtneps_pbh(v);
    _mm256_storeu_si256((__m256i *)p, (__m256i)h);
#else
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(vf_rne_bits(v), 16)));
#endif
}

static inline TGT vf vf_rnd_bf16(vf v) {
    return _mm512_castsi512_ps(_mm512_and_si512(vf_rne_bits(v), _mm512_set1_epi32((int)0xffff0000)));
}

static inline TGT vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline TGT vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline TGT vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline TGT vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline TGT vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline TGT vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline TGT vf vf_swap_pairs(vf a) { return _mm512_permute_ps(a, 0xB1); }
static inline TGT float vf_hsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline TGT float vf_hmax(vf a) { return _mm512_reduce_max_ps(a); }

/* Cephes-style expf: |rel err| ~ 2 ulp on [-87, 88]; clamps outside. */
static inline TGT vf vf_exp(vf x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
    __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, fx);
}

#endif
