/* Kernel tier "scalar": the generic kernels and the GEMM instantiated with this
 * tier's vector operations and target attribute (baseline compile flags). */
#include "simd_scalar.h"

#include "tier_kernels.h"

#include "tier_gemm.h"

const cpud_ops cpud_ops_scalar = {
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
