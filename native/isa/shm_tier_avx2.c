/* Shared-memory all-reduce sum, tier "avx2" (baseline compile flags; the
 * tier's target attribute comes from simd_avx2.h). */
#include "simd_avx2.h"

#define SHM_SUM_FN cpud_shm_sum_avx2
#include "shm_sum.h"
