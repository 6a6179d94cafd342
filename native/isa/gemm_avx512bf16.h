/* GEMM kernels of the avx512bf16 tier (tier_avx512bf16.c; also the amx tier's below its tile
 * threshold, gemm_amx.h): the 8-row vdpbf16ps micro-kernel straight on the packed pairs, x as
 * bf16 pairs, and the probes; the contract is in gemm_shape.h, the driver in tier_gemm.h. */
#include "gemm_shape.h"
#include "read_probe_avx512.h"

#define GEMM_MT 32 /* rows per C tile */

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

static ALWAYS_INLINE TGT double dpbf16_compute_probe(int64_t iters, float *total) {
    /* bf16 pairs (1.0039, 1.0039), multiplied as pairs by vdpbf16ps */
    const __m512 a0 = _mm512_castsi512_ps(_mm512_set1_epi32(0x3f803f80));
    __m512 acc[16], a = a0;
    for (int i = 0; i < 16; i++) acc[i] = _mm512_set1_ps((float)i);
    for (int64_t it = 0; it < iters; it++) {
        for (int i = 0; i < 16; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)a, (__m512bh)a0);
        __asm__ volatile("" : "+v"(a));
    }
    for (int i = 1; i < 16; i++) acc[0] = _mm512_add_ps(acc[0], acc[i]);
    *total += _mm512_reduce_add_ps(acc[0]);
    return (double)iters * 16 * 64;
}
#define GEMM_COMPUTE_PROBE dpbf16_compute_probe
