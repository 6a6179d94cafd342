/* Shared-memory all-reduce sum, tier "scalar" (baseline compile flags; the
 * tier's target attribute comes from simd_scalar.h). */
#include "simd_scalar.h"

#define SHM_SUM_FN cpud_shm_sum_scalar
#include "shm_sum.h"
