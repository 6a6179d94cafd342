/* GEMM kernels of the avx512 tier (tier_avx512.c): the 4-row FMA micro-kernel on bf16 pairs
 * widened in registers, and the probes; the contract is in gemm_shape.h, the driver in
 * tier_gemm.h. */
#include "gemm_shape.h"
#include "read_probe_avx512.h"

#define GEMM_MT 32 /* rows per C tile */

/* A 64-byte row of pairs splits into even k (shift) and odd k (mask) fp32 vectors of 16
 * columns; x stays fp32 */
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

static ALWAYS_INLINE TGT double fma512_compute_probe(int64_t iters, float *total) {
    /* bf16 pairs (1.0039, 1.0039), read as fp32 ~1.0039 by vfmadd */
    const __m512 a0 = _mm512_castsi512_ps(_mm512_set1_epi32(0x3f803f80));
    __m512 acc[16], a = a0;
    for (int i = 0; i < 16; i++) acc[i] = _mm512_set1_ps((float)i);
    for (int64_t it = 0; it < iters; it++) {
        for (int i = 0; i < 16; i++)
            acc[i] = _mm512_fmadd_ps(a, a0, acc[i]);
        __asm__ volatile("" : "+v"(a));
    }
    for (int i = 1; i < 16; i++) acc[0] = _mm512_add_ps(acc[0], acc[i]);
    *total += _mm512_reduce_add_ps(acc[0]);
    return (double)iters * 16 * 32;
}
#define GEMM_COMPUTE_PROBE fma512_compute_probe
