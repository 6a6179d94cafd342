/* Fixed-order sum of nsrc arrays (see shm.h), included once per tier after a
 * simd_*.h header (TGT, VW, vf_*) with SHM_SUM_FN naming the function.
 * The vector loop and the scalar tail give the same bits per element: fp32
 * adds in source order, then one round-to-nearest-even to bf16. */
#include "shm.h"

TGT void SHM_SUM_FN(int dt, void *dst, const void *const *src, int nsrc, int64_t n) {
    int64_t i = 0;
    if (dt == CPUD_BF16) {
        const uint16_t *const *s = (const uint16_t *const *)src;
        uint16_t *d = (uint16_t *)dst;
        for (; i + VW <= n; i += VW) {
            vf acc = vf_ld_bf16(s[0] + i);
            for (int p = 1; p < nsrc; p++) acc = vf_add(acc, vf_ld_bf16(s[p] + i));
            vf_st_bf16(d + i, acc);
        }
    } else {
        const float *const *s = (const float *const *)src;
        float *d = (float *)dst;
        for (; i + VW <= n; i += VW) {
            vf acc = vf_ld(s[0] + i);
            for (int p = 1; p < nsrc; p++) acc = vf_add(acc, vf_ld(s[p] + i));
            vf_st(d + i, acc);
        }
    }
    for (; i < n; i++) {
        float acc = ld1(src[0], i, dt);
        for (int p = 1; p < nsrc; p++) acc += ld1(src[p], i, dt);
        st1(dst, i, acc, dt);
    }
}
