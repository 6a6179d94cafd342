/* GEMM kernels of the avx2 tier (tier_avx2.c): the 2-row micro-kernel on bf16 pairs widened
 * in registers, 6 x 16 tiles on panels widened once per C tile for many rows, and the probes;
 * the contract is in gemm_shape.h, the driver in tier_gemm.h. */
#include "gemm_shape.h"

#define GEMM_MT 72 /* rows per C tile: whole groups of GEMM_WIDE_MR; 36 read the same */

/* Four 32-byte quarters of 8 columns, each split into even k (shift) and odd k (mask) fp32
 * vectors; x stays fp32 */
#define GEMM_MR 2
#define GEMM_XDT CPUD_F32
#define GEMM_X_BF16 0
typedef float xelem;

/* w: [nkp][32][2] bf16, x: [mr][xs] f32, c: [mr][32] f32 */
static ALWAYS_INLINE TGT void gemm_uk(const int mr, const uint16_t *w, int64_t nkp,
                                      const float *x, int64_t xs, float *c, int first,
                                      const uint16_t *pf, int64_t npf) {
    (void)pf;
    (void)npf;
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000);
    __m256 acc[GEMM_MR][4];
    for (int r = 0; r < mr; r++)
        for (int q = 0; q < 4; q++)
            acc[r][q] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * GEMM_NB + 8 * q);
    for (int64_t kp = 0; kp < nkp; kp++) {
        __m256 xa[GEMM_MR], xb[GEMM_MR];
        for (int r = 0; r < mr; r++) {
            xa[r] = _mm256_set1_ps(x[r * xs + 2 * kp]);
            xb[r] = _mm256_set1_ps(x[r * xs + 2 * kp + 1]);
        }
        for (int q = 0; q < 4; q++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + kp * 2 * GEMM_NB + 16 * q));
            const __m256 e = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            const __m256 o = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
            for (int r = 0; r < mr; r++)
                acc[r][q] = _mm256_fmadd_ps(o, xb[r], _mm256_fmadd_ps(e, xa[r], acc[r][q]));
        }
    }
    for (int r = 0; r < mr; r++)
        for (int q = 0; q < 4; q++) _mm256_storeu_ps(c + r * GEMM_NB + 8 * q, acc[r][q]);
}

/* GEMM_WIDE_MIN_M rows or more: converting each weight vector in the micro-kernel above costs two
 * integer ops per two rows of FMAs, and four rows of 32 columns do not fit in 16 registers.  So
 * a block of the panel is widened to fp32 once per C tile and every group of 6 rows multiplies
 * it from L1 in 6 x 16 tiles (12 accumulators, 2 weight vectors, 1 broadcast: the classic AVX2
 * shape).  x is prepared as groups of 6 rows interleaved by k ([group][kpad][6] fp32), so the
 * broadcasts read one sequential stream: six rows at a row stride of 4 KiB multiples would
 * share one L1 set with the widened block. */
#define GEMM_WIDE 1
#define GEMM_WIDE_MIN_M 48 /* paired A/B, Zen 3: 0.93-1.04x the micro-kernel above at M=32,
                              1.02-1.09x at 64, 1.06-1.12x at 512 */
#define GEMM_WIDE_MR 6
#define GEMM_WIDE_KC 64 /* k pairs per widened block: 16 KiB of fp32 */

/* w: [nkp][32][2] bf16 -> wf: [2 * nkp][32] f32 (k-major) */
static ALWAYS_INLINE TGT void gemm_widen(const uint16_t *w, int64_t nkp, float *wf) {
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000);
    for (int64_t kp = 0; kp < nkp; kp++)
        for (int q = 0; q < 4; q++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + kp * 2 * GEMM_NB + 16 * q));
            _mm256_store_ps(wf + 2 * kp * GEMM_NB + 8 * q, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
            _mm256_store_ps(wf + (2 * kp + 1) * GEMM_NB + 8 * q,
                            _mm256_castsi256_ps(_mm256_and_si256(v, hi)));
        }
}

/* wf: [nk][32] f32 (the 16 columns at wf), xg: [nk][6] f32 (rows interleaved),
 * c: [mr][32] f32 (the 16 columns at c) */
static ALWAYS_INLINE TGT void gemm_uk_wide(const int mr, const float *wf, int64_t nk,
                                           const float *xg, float *c, int first) {
    __m256 acc[GEMM_WIDE_MR][2];
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < 2; j++)
            acc[r][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * GEMM_NB + 8 * j);
    for (int64_t k = 0; k < nk; k++) {
        const __m256 b0 = _mm256_load_ps(wf + k * GEMM_NB), b1 = _mm256_load_ps(wf + k * GEMM_NB + 8);
        for (int r = 0; r < mr; r++) {
            const __m256 a = _mm256_broadcast_ss(xg + k * GEMM_WIDE_MR + r);
            acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < 2; j++) _mm256_storeu_ps(c + r * GEMM_NB + 8 * j, acc[r][j]);
}

static TGT void gemm_ukernel_wide(int mr, const float *wf, int64_t nk, const float *xg, float *c,
                                  int first) {
    switch (mr) {
#define UK_CASE(n)                                                                                 \
    case n: gemm_uk_wide(n, wf, nk, xg, c, first); break;
    UK_CASE(1)
    UK_CASE(2)
    UK_CASE(3)
    UK_CASE(4)
    UK_CASE(5)
    UK_CASE(6)
#undef UK_CASE
    default: break;
    }
}

/* c: [mt][32] f32 <- the mt rows of x at xg ([ceil(mt / 6)][kpad][6] f32) @ panel [nkp][32][2] */
static TGT void gemm_tile_wide(const uint16_t *panel, int64_t nkp, const float *xg, int64_t kpad,
                               int64_t mt, float *c) {
    float wf[2 * GEMM_WIDE_KC * GEMM_NB] __attribute__((aligned(64)));
    for (int64_t k0 = 0; k0 < nkp; k0 += GEMM_WIDE_KC) {
        const int64_t nk = nkp - k0 < GEMM_WIDE_KC ? nkp - k0 : GEMM_WIDE_KC;
        gemm_widen(panel + k0 * 2 * GEMM_NB, nk, wf);
        for (int64_t r0 = 0; r0 < mt; r0 += GEMM_WIDE_MR) {
            const int mr = (int)(mt - r0 < GEMM_WIDE_MR ? mt - r0 : GEMM_WIDE_MR);
            const float *xk = xg + (r0 * kpad + 2 * k0 * GEMM_WIDE_MR);
            for (int h = 0; h < 2; h++)
                gemm_ukernel_wide(mr, wf + 16 * h, 2 * nk, xk, c + r0 * GEMM_NB + 16 * h, k0 == 0);
        }
    }
}

/* rows [m0, m0 + 6) of x ([M][xs] xdt; rows >= M read as zero) -> dst: [kpad][6] f32 */
static TGT void gemm_prep_group(const void *x, int xdt, int64_t xs, int64_t m0, int64_t M,
                                int64_t K, float *dst, int64_t kpad) {
    float lanes[VW] __attribute__((aligned(32)));
    for (int r = 0; r < GEMM_WIDE_MR; r++) {
        int64_t k = 0;
        if (m0 + r < M) {
            const void *src = at(x, (m0 + r) * xs, xdt);
            for (; k + VW <= K; k += VW) {
                vf_st(lanes, ldv(src, k, xdt));
                for (int i = 0; i < VW; i++) dst[(k + i) * GEMM_WIDE_MR + r] = lanes[i];
            }
            for (; k < K; k++) dst[k * GEMM_WIDE_MR + r] = ld1(src, k, xdt);
        }
        for (; k < kpad; k++) dst[k * GEMM_WIDE_MR + r] = 0.0f;
    }
}


/* [b, e): 4 KiB aligned range -> xor of its 64-bit words (forces every load) */
static TGT uint64_t probe_range(const char *b, const char *e) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (const char *p = b; p < e; p += 128) {
        a0 = _mm256_xor_si256(a0, _mm256_load_si256((const __m256i *)p));
        a1 = _mm256_xor_si256(a1, _mm256_load_si256((const __m256i *)(p + 32)));
        a2 = _mm256_xor_si256(a2, _mm256_load_si256((const __m256i *)(p + 64)));
        a3 = _mm256_xor_si256(a3, _mm256_load_si256((const __m256i *)(p + 96)));
    }
    a0 = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, a0);
    uint64_t s = 0;
    for (size_t i = 0; i < sizeof lanes / sizeof lanes[0]; i++) s ^= lanes[i];
    return s;
}

static ALWAYS_INLINE TGT double avx2_compute_probe(int64_t iters, float *total) {
    /* 12 accumulators: with the two operands 14 of the 16 ymm registers (16 accumulators
     * spilled to the stack and read 116 GFLOP/s on a Zen 3 whose GEMM reaches 170) */
    __m256 acc[12];
    for (int i = 0; i < 12; i++) acc[i] = _mm256_set1_ps((float)i);
    __m256 a = _mm256_set1_ps(1.0f), b = _mm256_set1_ps(1e-6f);
    for (int64_t it = 0; it < iters; it++) {
        for (int i = 0; i < 12; i++) acc[i] = _mm256_fmadd_ps(a, b, acc[i]);
        __asm__ volatile("" : "+x"(a));
    }
    for (int i = 1; i < 12; i++) acc[0] = _mm256_add_ps(acc[0], acc[i]);
    float lanes[8];
    _mm256_storeu_ps(lanes, acc[0]);
    float sum = *total;
    for (int i = 0; i < 8; i++) sum += lanes[i];
    *total = sum;
    return (double)iters * 12 * 16;
}
#define GEMM_COMPUTE_PROBE avx2_compute_probe
