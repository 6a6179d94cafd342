/* Vector abstraction, scalar tier: a "vector" is one float.  Baseline x86-64
 * only (the compiler may still auto-vectorize with SSE2). */
#ifndef CPUD_SIMD_H
#define CPUD_SIMD_H

#include "common.h"

#define TGT
#define VW 1
#define TIER_ID 0
typedef float vf;

static inline vf vf_zero(void) { return 0.0f; }
static inline vf vf_set1(float a) { return a; }
static inline vf vf_ld(const float *p) { return *p; }
static inline void vf_st(float *p, vf v) { *p = v; }
static inline vf vf_ld_bf16(const uint16_t *p) { return bf16_to_f32(*p); }
static inline void vf_st_bf16(uint16_t *p, vf v) { *p = f32_to_bf16(v); }
static inline vf vf_rnd_bf16(vf v) { return bf16_to_f32(f32_to_bf16(v)); }
static inline vf vf_add(vf a, vf b) { return a + b; }
static inline vf vf_sub(vf a, vf b) { return a - b; }
static inline vf vf_mul(vf a, vf b) { return a * b; }
static inline vf vf_div(vf a, vf b) { return a / b; }
static inline vf vf_max(vf a, vf b) { return a > b ? a : b; }
static inline vf vf_fma(vf a, vf b, vf c) { return a * b + c; }
static inline float vf_hsum(vf a) { return a; }
static inline float vf_hmax(vf a) { return a; }
static inline vf vf_exp(vf a) { return expf(a); }

#endif
