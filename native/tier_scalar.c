/* Kernel tier "scalar": the generic kernels and the GEMM instantiated with this
 * tier's vector operations and target attribute (baseline compile flags). */
#include "simd_scalar.h"

#include "tier_kernels.h"

#include "tier_gemm.h"

#include "tier_ops.h"

CPUD_TIER_OPS(cpud_ops_scalar);
