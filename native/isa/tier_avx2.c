/* Kernel tier "avx2": the generic kernels and the GEMM driver instantiated with this
 * tier's vector operations, GEMM kernels (gemm_avx2.h) and target attribute (baseline compile
 * flags). */
#include "simd_avx2.h"

#include "tier_kernels.h"

#include "gemm_avx2.h"
#include "tier_gemm.h"

#include "tier_ops.h"

CPUD_TIER_OPS(cpud_ops_avx2);
