/* Kernel tier "scalar": the generic kernels and the GEMM driver instantiated with this
 * tier's vector operations, GEMM kernels (gemm_scalar.h) and target attribute (baseline compile
 * flags). */
#include "simd_scalar.h"

#include "tier_kernels.h"

#include "gemm_scalar.h"
#include "tier_gemm.h"

#include "tier_ops.h"

CPUD_TIER_OPS(cpud_ops_scalar);
