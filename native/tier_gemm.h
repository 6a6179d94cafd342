/* Skinny GEMM y[M][N] = x[M][K] @ W[N][K]^T over the packed weight layout
 * [ceil(N/32)][ceil(K/2)][32][2] bf16 (see cpud_native.h), plus the streaming
 * read probe and the compute probe it is measured against.  Included once per tier after
 * tier_kernels.h; the micro-kernel and the probe loop are tier specific
 * (TIER_ID), the driver is shared.
 *
 * Work split: each thread owns a contiguous range of 32-column panels, so it
 * streams one contiguous region of the packed weights exactly once (for
 * M <= GEMM_MT); a thread done with its range takes panels from the back of a
 * slower one's (work_ranges.h), so a descheduled thread costs one panel.  When
 * M exceeds what the micro-kernel holds in registers, K is blocked so that the
 * panel slice is re-read from L1, not from memory.  The amx tier (TIER_ID 4) runs 4+ rows on
 * AMX tiles instead, and splits large M into chunks of x that stay in L2: its work items are
 * (chunk, panel) pairs. */

#include "work_ranges.h"

#define GEMM_NB CPUD_GEMM_NB /* columns per panel */
#define GEMM_KC 128          /* k pairs per block when M > GEMM_MR: 16 KiB of panel */
#if TIER_ID == 1
#define GEMM_MT 72 /* rows per C tile: whole groups of GEMM_WIDE_MR; 36 read the same */
#else
#define GEMM_MT 32 /* rows per C tile */
#endif

#if TIER_ID >= 3
/* ---- AVX512-BF16 (and the AMX tier below GEMM_AMX_MIN_M rows): vdpbf16ps straight on the
 * packed pairs, x as bf16 pairs */
#define GEMM_MR 8
/* Unblocked (M <= GEMM_MR, weights read once): prefetch this far ahead of the weight stream.
 * Intel's L2 streamer stops at every 4 KiB page, so without it M=1 streams at ~70 % of the read
 * probe there (+30 % with it, Xeon with AMX, 2026-11-22); on Zen 4 a read loop gained nothing
 * from 0.5-4 KiB ahead and lost from 8 KiB. */
#define GEMM_STREAM_PF 4096
#define GEMM_XDT CPUD_BF16
#define GEMM_X_BF16 1 /* micro-kernel reads x as bf16 pairs */
typedef uint16_t xelem;

/* w: [nkp][32][2] bf16, x: [mr][xs] bf16 (pairs from k = 0), c: [mr][32] f32;
 * pf: NULL or npf 64-byte lines to prefetch into L2, one per k pair (into L1 they
 * would evict the block the other row groups are about to re-read: 5-20 % slower) */
static ALWAYS_INLINE TGT void gemm_uk(const int mr, const uint16_t *w, int64_t nkp,
                                      const uint16_t *x, int64_t xs, float *c, int first,
                                      const uint16_t *pf, int64_t npf) {
    __m512 acc[GEMM_MR][2], acc2[GEMM_MR][2];
    for (int r = 0; r < mr; r++)
        for (int h = 0; h < 2; h++) {
            acc[r][h] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * GEMM_NB + 16 * h);
            acc2[r][h] = _mm512_setzero_ps();
        }
    int64_t kp = 0;
    if (mr <= 4) { /* two k pairs per step on separate accumulators: more chains in flight */
        for (; kp + 2 <= nkp; kp += 2) {
            const uint16_t *wk = w + kp * 2 * GEMM_NB;
            if (!npf)
                for (int l = 0; l < 4; l++)
                    _mm_prefetch((const char *)wk + GEMM_STREAM_PF + 64 * l, _MM_HINT_T0);
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wk + 32);
            const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wk + 64);
            const __m512bh w3 = (__m512bh)_mm512_loadu_si512(wk + 96);
            for (int r = 0; r < mr; r++) {
                int32_t p0, p1;
                memcpy(&p0, x + r * xs + 2 * kp, 4);
                memcpy(&p1, x + r * xs + 2 * kp + 2, 4);
                const __m512bh b0 = (__m512bh)_mm512_set1_epi32(p0);
                const __m512bh b1 = (__m512bh)_mm512_set1_epi32(p1);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, b0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, b0);
                acc2[r][0] = _mm512_dpbf16_ps(acc2[r][0], w2, b1);
                acc2[r][1] = _mm512_dpbf16_ps(acc2[r][1], w3, b1);
            }
        }
    }
    for (; kp < nkp; kp++) {
        const uint16_t *wk = w + kp * 2 * GEMM_NB;
        if (kp < npf) __builtin_prefetch(pf + kp * 32, 0, 2);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wk + 32);
        for (int r = 0; r < mr; r++) {
            int32_t p0;
            memcpy(&p0, x + r * xs + 2 * kp, 4);
            const __m512bh b0 = (__m512bh)_mm512_set1_epi32(p0);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, b0);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int h = 0; h < 2; h++)
            _mm512_storeu_ps(c + r * GEMM_NB + 16 * h, _mm512_add_ps(acc[r][h], acc2[r][h]));
}

#elif TIER_ID == 2
/* ---- AVX-512: a 64-byte row of pairs splits into even k (shift) and odd k
 * (mask) fp32 vectors of 16 columns; x stays fp32 */
#define GEMM_MR 4
#define GEMM_XDT CPUD_F32
#define GEMM_X_BF16 0
typedef float xelem;

/* w: [nkp][32][2] bf16, x: [mr][xs] f32, c: [mr][32] f32 */
static ALWAYS_INLINE TGT void gemm_uk(const int mr, const uint16_t *w, int64_t nkp,
                                      const float *x, int64_t xs, float *c, int first,
                                      const uint16_t *pf, int64_t npf) {
    (void)pf;
    (void)npf;
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000);
    __m512 ae[GEMM_MR][2], ao[GEMM_MR][2];
    for (int r = 0; r < mr; r++)
        for (int h = 0; h < 2; h++) {
            ae[r][h] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * GEMM_NB + 16 * h);
            ao[r][h] = _mm512_setzero_ps();
        }
    for (int64_t kp = 0; kp < nkp; kp++) {
        __m512 e[2], o[2];
        for (int h = 0; h < 2; h++) {
            const __m512i v = _mm512_loadu_si512(w + kp * 2 * GEMM_NB + 32 * h);
            e[h] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            o[h] = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
        }
        for (int r = 0; r < mr; r++) {
            const __m512 xa = _mm512_set1_ps(x[r * xs + 2 * kp]);
            const __m512 xb = _mm512_set1_ps(x[r * xs + 2 * kp + 1]);
            for (int h = 0; h < 2; h++) {
                ae[r][h] = _mm512_fmadd_ps(e[h], xa, ae[r][h]);
                ao[r][h] = _mm512_fmadd_ps(o[h], xb, ao[r][h]);
            }
        }
    }
    for (int r = 0; r < mr; r++)
        for (int h = 0; h < 2; h++)
            _mm512_storeu_ps(c + r * GEMM_NB + 16 * h, _mm512_add_ps(ae[r][h], ao[r][h]));
}

#elif TIER_ID == 1
/* ---- AVX2: as AVX-512 with four 32-byte quarters of 8 columns */
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

#else
/* ---- scalar */
#define GEMM_MR 4
#define GEMM_XDT CPUD_F32
#define GEMM_X_BF16 0
typedef float xelem;

/* w: [nkp][32][2] bf16, x: [mr][xs] f32, c: [mr][32] f32 */
static ALWAYS_INLINE void gemm_uk(const int mr, const uint16_t *w, int64_t nkp, const float *x,
                                  int64_t xs, float *c, int first,
                                  const uint16_t *pf, int64_t npf) {
    (void)pf;
    (void)npf;
    if (first)
        for (int i = 0; i < mr * GEMM_NB; i++) c[i] = 0.0f;
    for (int64_t kp = 0; kp < nkp; kp++) {
        const uint16_t *wk = w + kp * 2 * GEMM_NB;
        for (int r = 0; r < mr; r++) {
            const float xa = x[r * xs + 2 * kp], xb = x[r * xs + 2 * kp + 1];
            for (int n = 0; n < GEMM_NB; n++)
                c[r * GEMM_NB + n] += bf16_to_f32(wk[2 * n]) * xa + bf16_to_f32(wk[2 * n + 1]) * xb;
        }
    }
}
#endif

#if TIER_ID == 4
/* ---- AMX-BF16: tiles 0-3 hold a 32 x 32 fp32 block of C (rows 0-15 / 16-31 x columns
 * 0-15 / 16-31), 4-5 two 16 x 32 bf16 blocks of x, 6-7 the panel's two column halves for 16 k
 * pairs, which the packed layout already is: row kp of a half is 16 columns x (k, k + 1), 64
 * bytes at a 128-byte stride.  Used from GEMM_AMX_MIN_M rows (fewer are bound by the weight
 * stream, where the vdpbf16ps micro-kernel is as fast) and for K a multiple of 32. */
#define GEMM_AMX_MIN_M 4
#define GEMM_AMX_KP 16 /* k pairs per tile step */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

/* Every tile 16 rows x 64 bytes; this thread's tile state until amx_release. */
static TGT void amx_configure(void) {
    amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}

static TGT void amx_release(void) { __asm__ volatile("tilerelease" ::); }

static int amx_fits(int64_t M, int64_t nkp) { return M >= GEMM_AMX_MIN_M && nkp % GEMM_AMX_KP == 0; }

/* Rows of x per chunk: ~1 MiB of bf16, whole 32-row blocks, so a chunk stays in L2 while every
 * panel of the weights streams past it (re-reading all of x from L3 per panel is slower). */
static int64_t amx_chunk_rows(int64_t M, int64_t kpad) {
    const int64_t rows = ((int64_t)1 << 20) / (2 * kpad) / GEMM_MT * GEMM_MT;
    return rows < GEMM_MT ? GEMM_MT : rows > M ? M : rows;
}

/* The 2 KiB of weights one tile step reads, 4 KiB ahead (on the first row block of a panel,
 * which reads it from memory): M=32 GEMMs 1.2-1.6x faster than with the hardware prefetcher
 * alone, which stops at every 4 KiB page; 2 or 8 KiB ahead, or into L2 only, no better. */
static ALWAYS_INLINE TGT void amx_prefetch(const uint16_t *w) {
    const char *p = (const char *)w + 4096;
    for (int l = 0; l < 32; l++) _mm_prefetch(p + 64 * l, _MM_HINT_T0);
}

/* panel: [nkp][32][2] bf16; x: [mt][xs] bf16 (rows beyond mt readable up to 16 or 32);
 * c: [32][32] f32 <- x @ panel, rows >= mt garbage; prefetch: the panel comes from memory */
static TGT void amx_block(const uint16_t *panel, int64_t nkp, const uint16_t *x, int64_t xs,
                          int64_t mt, float *c, int prefetch) {
    const long wstride = 2 * GEMM_NB * 2, xstride = xs * 2;
    const uint16_t *x1 = x + 16 * xs;
    _tile_zero(0);
    _tile_zero(1);
    if (mt > 16) {
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kp = 0; kp < nkp; kp += GEMM_AMX_KP) {
            const uint16_t *w = panel + kp * 2 * GEMM_NB;
            if (prefetch) amx_prefetch(w);
            _tile_loadd(6, w, wstride);
            _tile_loadd(7, w + GEMM_NB, wstride);
            _tile_loadd(4, x + 2 * kp, xstride);
            _tile_loadd(5, x1 + 2 * kp, xstride);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(2, c + 16 * GEMM_NB, GEMM_NB * 4);
        _tile_stored(3, c + 16 * GEMM_NB + 16, GEMM_NB * 4);
    } else {
        for (int64_t kp = 0; kp < nkp; kp += GEMM_AMX_KP) {
            const uint16_t *w = panel + kp * 2 * GEMM_NB;
            if (prefetch) amx_prefetch(w);
            _tile_loadd(6, w, wstride);
            _tile_loadd(7, w + GEMM_NB, wstride);
            _tile_loadd(4, x + 2 * kp, xstride);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
    }
    _tile_stored(0, c, GEMM_NB * 4);
    _tile_stored(1, c + 16, GEMM_NB * 4);
}
#endif

/* Dispatch to a micro-kernel specialised for mr rows (mr <= GEMM_MR). */
static TGT void gemm_ukernel(int mr, const uint16_t *w, int64_t nkp, const xelem *x, int64_t xs,
                             float *c, int first, const uint16_t *pf, int64_t npf) {
    switch (mr) {
#define UK_CASE(n)                                                                                 \
    case n: gemm_uk(n, w, nkp, x, xs, c, first, pf, npf); break;
    UK_CASE(1)
    UK_CASE(2)
#if GEMM_MR > 2
    UK_CASE(3)
    UK_CASE(4)
#endif
#if GEMM_MR > 4
    UK_CASE(5)
    UK_CASE(6)
    UK_CASE(7)
    UK_CASE(8)
#endif
#undef UK_CASE
    default: break;
    }
}

/* x: [K] row of xdt -> dst: [kpad] xelem, zero padded */
static TGT void gemm_prep_row(const void *x, int xdt, int64_t K, xelem *dst, int64_t kpad) {
    for (int64_t k = 0; k < K; k++) {
        const float v = ld1(x, k, xdt);
#if GEMM_X_BF16
        dst[k] = xdt == CPUD_BF16 ? ((const uint16_t *)x)[k] : f32_to_bf16(v);
#else
        dst[k] = v;
#endif
    }
    for (int64_t k = K; k < kpad; k++) dst[k] = 0;
}

/* c: [mt][32] f32 tile of columns [n0, n0 + 32) -> out rows (stride os) of odt, + bias */
static ALWAYS_INLINE TGT void gemm_store(const float *c, int64_t mt, int64_t n0, int64_t N,
                                         const float *bias32, void *out, int64_t os, int odt) {
    const int64_t nv = N - n0 < GEMM_NB ? N - n0 : GEMM_NB;
    for (int64_t r = 0; r < mt; r++) {
        void *o = at(out, r * os + n0, odt);
        int64_t i = 0;
        for (; i + VW <= nv; i += VW)
            stv(o, i, vf_add(vf_ld(c + r * GEMM_NB + i), vf_ld(bias32 + i)), odt);
        for (; i < nv; i++) st1(o, i, c[r * GEMM_NB + i] + bias32[i], odt);
    }
}

/* c: [mt][32] f32 <- x [mt][xs] @ panel [nkp][32][2] (work item `item` of range own), through
 * the micro-kernel.  When M exceeds what the micro-kernel holds in registers, K is blocked:
 * while the row groups re-read a block from L1, they prefetch the next one (of this panel, or of
 * the next panel, which follows it), each group an equal share, so the weights stream evenly
 * instead of in one burst per block. */
static TGT void gemm_tile(const uint16_t *panel, int64_t nkp, const xelem *x, int64_t xs,
                          int64_t mt, float *c, work_range *own, int64_t item) {
    const int64_t kc = mt <= GEMM_MR ? nkp : GEMM_KC;
    for (int64_t k0 = 0; k0 < nkp; k0 += kc) {
        const int64_t nk = nkp - k0 < kc ? nkp - k0 : kc;
        const int64_t groups = (mt + GEMM_MR - 1) / GEMM_MR;
        const int64_t share = (2 * kc + groups - 1) / groups;
        const int has_next = kc < nkp && (k0 + kc < nkp || work_has_after(own, item));
        const uint16_t *next = panel + (k0 + kc) * 2 * GEMM_NB;
        for (int64_t r0 = 0; r0 < mt; r0 += GEMM_MR)
            gemm_ukernel((int)(mt - r0 < GEMM_MR ? mt - r0 : GEMM_MR), panel + k0 * 2 * GEMM_NB, nk,
                         x + r0 * xs + 2 * k0, xs, c + r0 * GEMM_NB, k0 == 0,
                         next + r0 / GEMM_MR * share * 32, has_next ? share : 0);
    }
}

/* Arguments as cpud_gemm_packed; returns 0 or CPUD_ENOMEM. */
static TGT int gemm_packed_k(const void *x, int xdt, int64_t xs, const uint16_t *packed,
                             const void *bias, int bdt, void *out, int odt, int64_t os, int64_t M,
                             int64_t N, int64_t K) {
    const int64_t nkp = (K + 1) / 2, kpad = 2 * nkp, np = (N + GEMM_NB - 1) / GEMM_NB;
#ifdef GEMM_WIDE
    const int wide = M >= GEMM_WIDE_MIN_M; /* x prepared in row groups for gemm_tile_wide */
    const int64_t xrows = wide ? (M + GEMM_WIDE_MR - 1) / GEMM_WIDE_MR * GEMM_WIDE_MR : M;
#else
    const int wide = 0;
    const int64_t xrows = M;
#endif
    const int direct = !wide && xdt == GEMM_XDT && K % 2 == 0;
    xelem *xp = NULL;
    if (!direct) {
        const size_t bytes = ((size_t)(xrows * kpad) * sizeof(xelem) + 63) & ~(size_t)63;
        xp = aligned_alloc(64, bytes);
        if (!xp) return CPUD_ENOMEM;
    }
    const xelem *xv = direct ? (const xelem *)x : xp;
    const int64_t xvs = direct ? xs : kpad;
#if TIER_ID == 4
    const int amx = amx_fits(M, nkp);
    const int64_t mc = amx ? amx_chunk_rows(M, kpad) : M;
#else
    const int64_t mc = M;
#endif
    /* items: (chunk of mc rows, panel), chunk-major, so a thread's contiguous range runs
     * through all panels against one chunk of x, which stays in its L2 */
    const int64_t items = np * ((M + mc - 1) / mc);
    /* one range per thread the region may get; ranges of threads it does not get are stolen */
    const int nr = items > 1 ? omp_get_max_threads() : 1;
    int failed = 0;
    work_range *ranges = work_ranges_new(items, nr);
    if (!ranges) {
        free(xp);
        return CPUD_ENOMEM;
    }
#pragma omp parallel if (items > 1) reduction(| : failed)
    {
#ifdef GEMM_WIDE
        if (wide) {
#pragma omp for schedule(static)
            for (int64_t m0 = 0; m0 < M; m0 += GEMM_WIDE_MR)
                gemm_prep_group(x, xdt, xs, m0, M, K, xp + m0 * kpad, kpad);
        } else
#endif
        if (!direct) {
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++) gemm_prep_row(at(x, m * xs, xdt), xdt, K, xp + m * kpad, kpad);
        }
        const int tid = omp_get_thread_num() < nr ? omp_get_thread_num() : 0;
        float c[GEMM_MT * GEMM_NB] __attribute__((aligned(64)));
        float b32[GEMM_NB] __attribute__((aligned(64)));
#if TIER_ID == 4
        /* the last, partial block of rows, padded with zero rows: tiles load 16 or 32 */
        uint16_t *tail = NULL;
        const int64_t tail0 = M / GEMM_MT * GEMM_MT;
        if (amx) {
            amx_configure();
            if (tail0 < M && (tail = aligned_alloc(64, GEMM_MT * kpad * 2)) != NULL) {
                memset(tail, 0, GEMM_MT * kpad * 2);
                for (int64_t m = tail0; m < M; m++)
                    memcpy(tail + (m - tail0) * kpad, xv + m * xvs, K * 2);
            }
            if (tail0 < M && !tail) failed = 1;
        }
#endif
        for (int64_t item; !failed && (item = work_next(ranges, nr, tid)) >= 0;) {
            const int64_t p = item % np, m_end = item / np * mc + mc < M ? item / np * mc + mc : M;
            const uint16_t *panel = packed + p * nkp * 2 * GEMM_NB;
            for (int64_t i = 0; i < GEMM_NB; i++)
                b32[i] = bias && p * GEMM_NB + i < N ? ld1(bias, p * GEMM_NB + i, bdt) : 0.0f;
            for (int64_t m0 = item / np * mc; m0 < m_end; m0 += GEMM_MT) {
                const int64_t mt = m_end - m0 < GEMM_MT ? m_end - m0 : GEMM_MT;
#if TIER_ID == 4
                if (amx) {
                    if (m0 < tail0)
                        amx_block(panel, nkp, xv + m0 * xvs, xvs, mt, c, m0 == item / np * mc);
                    else
                        amx_block(panel, nkp, tail, kpad, mt, c, m0 == item / np * mc);
                } else
#endif
#ifdef GEMM_WIDE
                if (wide)
                    gemm_tile_wide(panel, nkp, xp + m0 * kpad, kpad, mt, c);
                else
#endif
                    gemm_tile(panel, nkp, xv + m0 * xvs, xvs, mt, c, &ranges[tid], item);
                if (odt == CPUD_BF16)
                    gemm_store(c, mt, p * GEMM_NB, N, b32, at(out, m0 * os, odt), os, CPUD_BF16);
                else
                    gemm_store(c, mt, p * GEMM_NB, N, b32, at(out, m0 * os, odt), os, CPUD_F32);
            }
        }
#if TIER_ID == 4
        if (amx) amx_release();
        free(tail);
#endif
    }
    free(ranges);
    free(xp);
    return failed ? CPUD_ENOMEM : CPUD_OK;
}

/* ------------------------------------------------------------ read probe */

/* [b, e): 4 KiB aligned range -> xor of its 64-bit words (forces every load) */
static TGT uint64_t probe_range(const char *b, const char *e) {
#if TIER_ID >= 2
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (const char *p = b; p < e; p += 256) {
        a0 = _mm512_xor_si512(a0, _mm512_load_si512((const void *)p));
        a1 = _mm512_xor_si512(a1, _mm512_load_si512((const void *)(p + 64)));
        a2 = _mm512_xor_si512(a2, _mm512_load_si512((const void *)(p + 128)));
        a3 = _mm512_xor_si512(a3, _mm512_load_si512((const void *)(p + 192)));
    }
    a0 = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
    uint64_t lanes[8];
    _mm512_storeu_si512((void *)lanes, a0);
#elif TIER_ID == 1
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
#else
    uint64_t lanes[4] = {0, 0, 0, 0};
    for (const char *p = b; p < e; p += 32) {
        uint64_t v[4];
        memcpy(v, p, sizeof v);
        for (int i = 0; i < 4; i++) lanes[i] ^= v[i];
    }
#endif
    uint64_t s = 0;
    for (size_t i = 0; i < sizeof lanes / sizeof lanes[0]; i++) s ^= lanes[i];
    return s;
}

/* buf: [bytes] 64-byte aligned, bytes % 4096 == 0; each thread reads its
 * contiguous share. */
static TGT uint64_t read_probe_k(const void *buf, int64_t bytes) {
    const int64_t pages = bytes / 4096;
    uint64_t sum = 0;
#pragma omp parallel reduction(^ : sum)
    {
        const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
        const char *b = (const char *)buf + pages * tid / nt * 4096;
        const char *e = (const char *)buf + pages * (tid + 1) / nt * 4096;
        sum ^= probe_range(b, e);
    }
    return sum;
}

/* ---------------------------------------------------------- compute probe */

/* iters x 16 (avx2: 12) independent multiply-adds of the tier's widest kind (vdpbf16ps, vfmadd
 * on zmm or ymm, scalar fmaf) per thread, all in registers: the instruction peak the GEMM
 * micro-kernel is measured against.  Returns the FLOPs done by all threads; *sink takes a value that
 * depends on every result, so nothing is optimised away. */
static TGT double compute_probe_k(int64_t iters, float *sink) {
    double flops = 0.0;
    float total = 0.0f;
#pragma omp parallel reduction(+ : flops, total)
    {
#if TIER_ID == 4
        /* tdpbf16ps on four independent 16 x 16 accumulator tiles: 16 x 16 x 32 multiply-adds
         * per instruction */
        uint16_t ab[16 * 32] __attribute__((aligned(64)));
        float cs[16 * 16] __attribute__((aligned(64)));
        for (int i = 0; i < 16 * 32; i++) ab[i] = 0x3f80; /* 1.0 */
        amx_configure();
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        _tile_loadd(4, ab, 64);
        _tile_loadd(6, ab, 64);
        for (int64_t it = 0; it < iters; it++)
            for (int i = 0; i < 4; i++) {
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 6);
                _tile_dpbf16ps(2, 4, 6);
                _tile_dpbf16ps(3, 4, 6);
            }
        _tile_stored(3, cs, 64);
        amx_release();
        for (int i = 0; i < 16 * 16; i++) total += cs[i];
        flops += (double)iters * 16 * 16 * 16 * 32 * 2;
#elif TIER_ID >= 2
        /* bf16 pairs (1.0039, 1.0039), read as fp32 ~1.0039 by vfmadd */
        const __m512 a0 = _mm512_castsi512_ps(_mm512_set1_epi32(0x3f803f80));
        __m512 acc[16], a = a0;
        for (int i = 0; i < 16; i++) acc[i] = _mm512_set1_ps((float)i);
        for (int64_t it = 0; it < iters; it++) {
            for (int i = 0; i < 16; i++)
#if TIER_ID >= 3
                acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)a, (__m512bh)a0);
#else
                acc[i] = _mm512_fmadd_ps(a, a0, acc[i]);
#endif
            __asm__ volatile("" : "+v"(a));
        }
        for (int i = 1; i < 16; i++) acc[0] = _mm512_add_ps(acc[0], acc[i]);
        total += _mm512_reduce_add_ps(acc[0]);
        flops += (double)iters * 16 * (TIER_ID >= 3 ? 64 : 32);
#elif TIER_ID == 1
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
        for (int i = 0; i < 8; i++) total += lanes[i];
        flops += (double)iters * 12 * 16;
#else
        float acc[16];
        for (int i = 0; i < 16; i++) acc[i] = (float)i;
        float a = 1.0f, b = 1e-6f;
        for (int64_t it = 0; it < iters; it++) {
            for (int i = 0; i < 16; i++) acc[i] = a * b + acc[i];
            __asm__ volatile("" : "+x"(a));
        }
        for (int i = 0; i < 16; i++) total += acc[i];
        flops += (double)iters * 16 * 2;
#endif
    }
    *sink = total;
    return flops;
}
