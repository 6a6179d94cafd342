/* Kernel tier "avx512": the generic kernels and the GEMM driver instantiated with this
 * tier's vector operations, GEMM kernels (gemm_avx512.h) and target attribute (baseline compile
 * flags). */
#include "simd_avx512.h"

#include "tier_kernels.h"

#include "gemm_avx512.h"
#include "tier_gemm.h"

#include "tier_ops.h"

CPUD_TIER_OPS(cpud_ops_avx512);
