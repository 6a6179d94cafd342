/* GEMM kernels of the scalar tier (tier_scalar.c): the micro-kernel on plain floats and the
 * probes; the contract is in gemm_shape.h, the driver in tier_gemm.h. */
#include "gemm_shape.h"

#define GEMM_MT 32 /* rows per C tile */

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

/* [b, e): 4 KiB aligned range -> xor of its 64-bit words (forces every load) */
static TGT uint64_t probe_range(const char *b, const char *e) {
    uint64_t lanes[4] = {0, 0, 0, 0};
    for (const char *p = b; p < e; p += 32) {
        uint64_t v[4];
        memcpy(v, p, sizeof v);
        for (int i = 0; i < 4; i++) lanes[i] ^= v[i];
    }
    uint64_t s = 0;
    for (size_t i = 0; i < sizeof lanes / sizeof lanes[0]; i++) s ^= lanes[i];
    return s;
}

/* 16 independent multiply-add chains per thread */
static ALWAYS_INLINE TGT double scalar_compute_probe(int64_t iters, float *total) {
    float acc[16];
    for (int i = 0; i < 16; i++) acc[i] = (float)i;
    float a = 1.0f, b = 1e-6f;
    for (int64_t it = 0; it < iters; it++) {
        for (int i = 0; i < 16; i++) acc[i] = a * b + acc[i];
        __asm__ volatile("" : "+x"(a));
    }
    float sum = *total;
    for (int i = 0; i < 16; i++) sum += acc[i];
    *total = sum;
    return (double)iters * 16 * 2;
}
#define GEMM_COMPUTE_PROBE scalar_compute_probe
