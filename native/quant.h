/* Internals shared by the quantized-GEMM kernels (quant_*.c): the packed layout of each type,
 * the int8 activations, the kernel table of one variant, and the output store.  No target
 * attributes here. */
#ifndef CPUD_QUANT_H
#define CPUD_QUANT_H

#include "common.h"

/* The avxvnni target attribute exists from gcc 11 and clang 12. */
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define CPUD_CAN_AVXVNNI 1
#else
#define CPUD_CAN_AVXVNNI 0
#endif

#define QR CPUD_QROWS
/* Rows of x one task takes (the weights of a group stay in L1/L2 across them). */
#define QMC 64

/* Kernel variants, lowest first. */
enum { QV_SCALAR, QV_AVX2, QV_AVX2_VNNI, QV_AVX512, QV_AVX512_VNNI, QV_COUNT };

/* x quantized: per row, blocks of 32 int8 with an fp32 scale and int32 sums of each 16. */
typedef struct qact {
    const int8_t *q;  /* [M][K]     */
    const float *d;   /* [M][K/32]  */
    const int32_t *s; /* [M][K/16]  */
    int64_t K;
} qact;

/* Per qtype: k per block, bytes of quants and of scales per block of 16 rows. */
static const int q_bs[] = {32, 32, 32, 256, 256, 256};
static const int q_qbytes[] = {512, 256, 256, 2048, 2560, 3072};
static const int q_sbytes[] = {32, 32, 64, 320, 320, 288};

typedef struct cpud_qops {
    const char *name;
    /* x: [M][K] rows xs apart, dtype dt -> a's buffers */
    void (*quantize)(const void *x, int dt, int64_t xs, int64_t M, int64_t K, int8_t *q,
                     float *d, int32_t *s);
    /* out[M][N] (row stride os, dtype odt) = a @ W^T + bias (bias: [N] f32 or NULL) */
    void (*gemm)(int qtype, const qact *a, const uint8_t *qs, const uint8_t *sc,
                 const float *bias, void *out, int odt, int64_t os, int64_t M, int64_t N);
    double (*probe)(int64_t iters, float *sink);
} cpud_qops;

extern const cpud_qops cpud_qops_scalar, cpud_qops_avx2, cpud_qops_avx2_vnni, cpud_qops_avx512,
    cpud_qops_avx512_vnni;

static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t u;
    if (e == 0) {
        const float f = ldexpf((float)m, -24);
        return sign ? -f : f;
    }
    u = e == 31 ? (0x7f800000u | m << 13) : ((e + 112) << 23 | m << 13);
    u |= sign;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* res: [mr][16] rows m0.. of x, output rows g*16..; writes the rows below N. */
static inline void q_store(const float *res, int mr, int64_t m0, int64_t g, int64_t N,
                           const float *bias, void *out, int odt, int64_t os) {
    const int64_t n0 = g * QR, nr = N - n0 < QR ? N - n0 : QR;
    for (int m = 0; m < mr; m++)
        for (int64_t r = 0; r < nr; r++)
            st1(out, (m0 + m) * os + n0 + r, res[m * QR + r] + (bias ? bias[n0 + r] : 0.0f), odt);
}

#endif
