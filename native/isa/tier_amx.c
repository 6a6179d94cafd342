/* Kernel tier "amx": the AVX512-BF16 tier's kernels, with GEMMs of GEMM_AMX_MIN_M rows or more
 * on AMX-BF16 tiles (gemm_amx.h).  dispatch.c offers it only where cpuid, XCR0 and the
 * kernel's permission (arch_prctl ARCH_REQ_XCOMP_PERM) all allow tile data. */
#include "common.h"

#if CPUD_CAN_AMX
#define CPUD_WITH_BF16 1
#define CPUD_WITH_AMX 1
#include "simd_avx512.h"

#include "tier_kernels.h"

#include "gemm_amx.h"
#include "tier_gemm.h"

#include "tier_ops.h"

CPUD_TIER_OPS(cpud_ops_amx);
#else
const cpud_ops cpud_ops_amx; /* never handed out: dispatch.c does not detect the tier */
#endif
