/* Internal to the shared-memory collectives (shm_allreduce.c): the per-tier
 * element-wise sum, instantiated by shm_tier_*.c from shm_sum.h. */
#ifndef CPUD_SHM_H
#define CPUD_SHM_H

#include <stdint.h>

/* dst[i] = src[0][i] + src[1][i] + ... + src[nsrc-1][i], accumulated in fp32
 * left to right (fixed order, so every rank gets the same bits) and rounded
 * once to dt.  dst may alias any src.  dst, src[p]: [n] of dt. */
typedef void (*cpud_shm_sum_fn)(int dt, void *dst, const void *const *src, int nsrc, int64_t n);

void cpud_shm_sum_scalar(int dt, void *dst, const void *const *src, int nsrc, int64_t n);
void cpud_shm_sum_avx2(int dt, void *dst, const void *const *src, int nsrc, int64_t n);
void cpud_shm_sum_avx512(int dt, void *dst, const void *const *src, int nsrc, int64_t n);

#endif
