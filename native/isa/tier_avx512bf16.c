/* Kernel tier "avx512bf16": the generic kernels and the GEMM driver instantiated with this
 * tier's vector operations, GEMM kernels (gemm_avx512bf16.h) and target attribute (baseline compile
 * flags). */
#define CPUD_WITH_BF16 1
#include "simd_avx512.h"

#include "tier_kernels.h"

#include "gemm_avx512bf16.h"
#include "tier_gemm.h"

#include "tier_ops.h"

CPUD_TIER_OPS(cpud_ops_avx512bf16);
