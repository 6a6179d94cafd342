/* Shared helpers for every tier: scalar bf16 conversion, dtype-generic scalar
 * access and the per-tier kernel table.  Nothing here carries a target
 * attribute, so it is safe on any x86-64 and inlines into every tier. */
#ifndef CPUD_COMMON_H
#define CPUD_COMMON_H

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "cpud_native.h"

#define ALWAYS_INLINE inline __attribute__((always_inline))

/* The AMX target attributes exist from gcc 11 and clang 12; with an older compiler the amx tier
 * is not built and never detected. */
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define CPUD_CAN_AMX 1
#else
#define CPUD_CAN_AMX 0
#endif
/* Below this many elements a kernel runs on the calling thread only. */
#define CPUD_PAR_MIN 32768
/* Whether a row-wise kernel over `rows` rows and `work` elements opens its own parallel region:
 * not when small, nor inside a team (a decoder's threads each pass it their share of rows). */
static inline int cpud_par_ok(int64_t work, int64_t rows) {
    return work >= CPUD_PAR_MIN && rows > 1 && !omp_in_parallel();
}
/* for (int64_t i = 0; i < n; i++) { body }: over a parallel region's threads (static schedule)
 * where par holds, else on the calling thread without entering one: even a region of one thread
 * costs about a microsecond (libgomp sets up a team for it), which the decode team's row-wise ops
 * would pay on every call. */
#define CPUD_PAR_FOR(par, i, n, ...)                                                               \
    do {                                                                                           \
        if (par) {                                                                                 \
            _Pragma("omp parallel for schedule(static)") for (int64_t i = 0; i < (n); i++) {      \
                __VA_ARGS__                                                                        \
            }                                                                                      \
        } else {                                                                                   \
            for (int64_t i = 0; i < (n); i++) {                                                    \
                __VA_ARGS__                                                                        \
            }                                                                                      \
        }                                                                                          \
    } while (0)
/* Largest rotary dimension the kernels accept. */
#define CPUD_ROT_MAX 1024

/* CLOCK_MONOTONIC in nanoseconds. */
static inline int64_t cpud_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, NaN -> canonical quiet NaN (torch's rule). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline int dtype_size(int dt) { return dt == CPUD_BF16 ? 2 : 4; }

/* p: [>i] of dt */
static ALWAYS_INLINE float ld1(const void *p, int64_t i, int dt) {
    return dt == CPUD_BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* p: [>i] of dt */
static ALWAYS_INLINE void st1(void *p, int64_t i, float v, int dt) {
    if (dt == CPUD_BF16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* v rounded to dt's precision (what a store and reload would give). */
static ALWAYS_INLINE float rnd1(float v, int dt) {
    return dt == CPUD_BF16 ? bf16_to_f32(f32_to_bf16(v)) : v;
}

struct att_plan;

/* One tier's kernels; argument meanings as in cpud_native.h, pointers typed. */
typedef struct cpud_ops {
    void (*rms_norm)(int dt, const void *x, int64_t xs, void *out, int64_t os, const void *w,
                     int wdt, int64_t T, int64_t n, int64_t H, float eps);
    void (*fused_add_rms_norm)(int dt, void *x, int64_t xs, void *res, int64_t rs, const void *w,
                               int wdt, int64_t T, int64_t H, float eps);
    void (*rotary)(int dt, const int64_t *pos, void *q, int64_t qs, void *k, int64_t ks,
                   const float *cos_sin, int64_t T, int64_t nh, int64_t nkv, int64_t hd,
                   int64_t rot, int neox);
    /* gate at x[t xs + i], up at x[t xs + up + i], i < I */
    void (*silu_and_mul)(int dt, const void *x, int64_t xs, void *out, int64_t os, int64_t T,
                         int64_t I, int64_t up);
    void (*gelu_tanh_and_mul)(int dt, const void *x, int64_t xs, void *out, int64_t os, int64_t T,
                              int64_t I, int64_t up);
    void (*argmax_rows)(int dt, const void *x, int64_t xs, int64_t rows, int64_t n,
                        int64_t *out);
    /* kv_hadamard on rows [rows][hd] f32 in place, vectorised */
    void (*hadamard_rows)(float *x, int64_t rows, int64_t hd, int query);
    /* rot: the caches' quantized rows are in kv_hadamard's basis, q is rotated likewise (by the
     * caller), and the output is rotated back (kv_formats.h) */
    int (*paged_attention)(int dt, int kvt, int rot, const void *q, int64_t qs, const void *kc,
                           const void *vc, const int32_t *qsl, const int32_t *seq_lens,
                           const int32_t *bt, int64_t max_blocks, void *out, int64_t os,
                           int64_t S, int64_t nh, int64_t nkv, int64_t hd, int64_t bs,
                           float scale, int64_t window, const float *sinks);
    /* paged_attention without a parallel region: the items of plan (att_plan.h) thread tid
     * takes; every thread of the caller's team calls it once */
    int (*paged_attention_part)(int dt, int kvt, int rot, const void *q, int64_t qs, const void *kc,
                                const void *vc, const int32_t *qsl, const int32_t *seq_lens,
                                const int32_t *bt, int64_t max_blocks, void *out, int64_t os,
                                int64_t nh, int64_t nkv, int64_t hd, int64_t bs, float scale,
                                int64_t window, const float *sinks, const struct att_plan *plan,
                                int tid);
    int (*gemm_packed)(const void *x, int xdt, int64_t xs, const uint16_t *packed,
                       const void *bias, int bdt, void *out, int odt, int64_t os, int64_t M,
                       int64_t N, int64_t K);
    /* gemm_packed without a parallel region: thread tid of nth computes its share; every
     * thread of the caller's team calls it once */
    int (*gemm_packed_part)(const void *x, int xdt, int64_t xs, const uint16_t *packed,
                            const void *bias, int bdt, void *out, int odt, int64_t os, int64_t M,
                            int64_t N, int64_t K, int tid, int nth);
    uint64_t (*read_probe)(const void *buf, int64_t bytes);
    double (*compute_probe)(int64_t iters, float *sink);
} cpud_ops;

extern const cpud_ops cpud_ops_scalar;
extern const cpud_ops cpud_ops_avx2;
extern const cpud_ops cpud_ops_avx512;
extern const cpud_ops cpud_ops_avx512bf16;
extern const cpud_ops cpud_ops_amx;

#endif
