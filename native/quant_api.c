/* Public entry points of the quantized GEMM (cpud_native.h): argument checks, the kernel
 * variant for (isa, flags), and the int8 activation buffers of one call. */
#include <stdlib.h>

#include "dispatch.h"
#include "quant.h"

/* avx2 takes AVX-VNNI, the avx512 tiers AVX512-VNNI, where the CPU has it and flags allow. */
static const cpud_qops *qops_for(int isa, int flags) {
    if (!cpud_ops_for(isa)) return NULL;
    const int vnni = flags & CPUD_QUANT_NO_VNNI ? 0 : cpud_vnni_bits();
    if (isa >= CPUD_ISA_AVX512) return vnni & 2 ? &cpud_qops_avx512_vnni : &cpud_qops_avx512;
    if (isa == CPUD_ISA_AVX2)
        return (vnni & 1) && CPUD_CAN_AVXVNNI ? &cpud_qops_avx2_vnni : &cpud_qops_avx2;
    return &cpud_qops_scalar;
}

static int dt_ok(int dt) { return dt == CPUD_F32 || dt == CPUD_BF16; }

int cpud_quant_gemm(int isa, int flags, int qtype, intptr_t x, int x_dtype, int64_t x_stride,
                    intptr_t qs, intptr_t sc, intptr_t bias, intptr_t out, int out_dtype,
                    int64_t out_stride, int64_t M, int64_t N, int64_t K) {
    const cpud_qops *ops = qops_for(isa, flags);
    if (!ops) return CPUD_EISA;
    if (qtype < CPUD_Q8_0 || qtype > CPUD_Q6_K || !dt_ok(x_dtype) || !dt_ok(out_dtype) || !x ||
        !qs || qs % 64 || !sc || !out || M < 0 || N < 1 || K < 1 || K % q_bs[qtype] ||
        (M > 1 && (x_stride < K || out_stride < N)))
        return CPUD_EARG;
    if (M == 0) return CPUD_OK;
    const size_t nq = (size_t)(M * K + 63) / 64 * 64;
    char *buf = aligned_alloc(64, nq + (size_t)(M * K / 32) * sizeof(float) +
                                      (size_t)(M * K / 16) * sizeof(int32_t));
    if (!buf) return CPUD_ENOMEM;
    const qact a = {(const int8_t *)buf, (const float *)(buf + nq),
                    (const int32_t *)(buf + nq + (size_t)(M * K / 32) * sizeof(float)), K};
    ops->quantize((const void *)x, x_dtype, x_stride, M, K, (int8_t *)a.q, (float *)a.d,
                  (int32_t *)a.s);
    ops->gemm(qtype, &a, (const uint8_t *)qs, (const uint8_t *)sc, (const float *)bias,
              (void *)out, out_dtype, out_stride, M, N);
    free(buf);
    return CPUD_OK;
}

const char *cpud_quant_kernel(int isa, int flags) {
    const cpud_qops *ops = qops_for(isa, flags);
    return ops ? ops->name : "none";
}

double cpud_quant_compute_probe(int isa, int flags, int64_t iters) {
    const cpud_qops *ops = qops_for(isa, flags);
    if (!ops || iters < 0) return -1.0;
    float sink = 0.0f;
    return ops->probe(iters, &sink);
}
