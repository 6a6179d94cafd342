/* The kernel table of one tier: included by each tier_*.c after tier_kernels.h and
 * tier_gemm.h, whose static kernels it names. */
#define CPUD_TIER_OPS(name)                                                                        \
    const cpud_ops name = {                                                                        \
        .rms_norm = rms_norm_k,                                                                    \
        .fused_add_rms_norm = fused_add_rms_norm_k,                                                \
        .rotary = rotary_k,                                                                        \
        .silu_and_mul = silu_and_mul_k,                                                            \
        .gelu_tanh_and_mul = gelu_tanh_and_mul_k,                                                  \
        .argmax_rows = argmax_rows_k,                                                              \
        .hadamard_rows = hadamard_rows_k,                                                          \
        .paged_attention = paged_attention_k,                                                      \
        .paged_attention_part = paged_attention_part_k,                                            \
        .gemm_packed = gemm_packed_k,                                                              \
        .gemm_packed_part = gemm_packed_part_k,                                                    \
        .read_probe = read_probe_k,                                                                \
        .compute_probe = compute_probe_k,                                                          \
    }
