/* Kernel tier "amx": the AVX512-BF16 tier's kernels, with GEMMs of GEMM_AMX_MIN_M rows or more
 * on AMX-BF16 tiles (tier_gemm.h).  dispatch.c offers it only where cpuid, XCR0 and the
 * kernel's permission (arch_prctl ARCH_REQ_XCOMP_PERM) all allow tile data. */
#define CPUD_WITH_BF16 1
#define CPUD_WITH_AMX 1
#include "simd_avx512.h"

#include "tier_kernels.h"

#include "tier_gemm.h"

const cpud_ops cpud_ops_amx = {
    .rms_norm = rms_norm_k,
    .fused_add_rms_norm = fused_add_rms_norm_k,
    .rotary = rotary_k,
    .silu_and_mul = silu_and_mul_k,
    .argmax_rows = argmax_rows_k,
    .paged_attention = paged_attention_k,
    .gemm_packed = gemm_packed_k,
    .read_probe = read_probe_k,
    .compute_probe = compute_probe_k,
};
