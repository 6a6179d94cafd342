/* Shared-memory all-reduce sum, tier "avx512" (baseline compile flags; the
 * tier's target attribute comes from simd_avx512.h). */
#include "simd_avx512.h"

#define SHM_SUM_FN cpud_shm_sum_avx512
#include "shm_sum.h"
