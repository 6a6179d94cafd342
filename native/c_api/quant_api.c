/* Public entry points of the quantized GEMM (cpud_native.h): argument checks, the kernel
 * variant for (isa, flags), and the int8 activation buffers of a call (the calling thread's
 * scratch, allocated once and grown as needed). */
#include <stdlib.h>

#include "dispatch.h"
#include "quant.h"

/* enum cpud_qtype (the public header) names the codes of quant_formats.h. */
#define CPUD_KERNEL_FORMAT(name, ggml_type, block_values, block_bytes, code, ...)                 \
    _Static_assert(CPUD_##name == code, "enum cpud_qtype: " #name " is not code " #code);
#include "quant_formats.h"
/* Every code 0 .. Q_TYPES - 1 has its format (a gap would leave a zeroed entry in q_fmt). */
#define CPUD_KERNEL_FORMAT(...) +1
enum { Q_LISTED = 0
#include "quant_formats.h"
};
_Static_assert(Q_LISTED == Q_TYPES, "quant_formats.h: kernel codes must run 0, 1, ... unbroken");

/* The amx tier itself implies tile data permission (dispatch.c). */
static int amx_int8(void) { return CPUD_CAN_AMX && (cpud_vnni_bits() & 4); }

/* avx2 takes AVX-VNNI, the avx512 tiers AVX512-VNNI, the amx tier AMX-INT8 tiles, where the CPU
 * has them and flags allow. */
static const cpud_qops *qops_for(int isa, int flags) {
    if (!cpud_ops_for(isa)) return NULL;
    const int vnni = flags & CPUD_QUANT_NO_VNNI ? 0 : cpud_vnni_bits();
    if (isa >= CPUD_ISA_AMX && (vnni & 2) && !(flags & CPUD_QUANT_NO_AMX) && amx_int8())
        return &cpud_qops_amx;
    if (isa >= CPUD_ISA_AVX512) return vnni & 2 ? &cpud_qops_avx512_vnni : &cpud_qops_avx512;
    if (isa == CPUD_ISA_AVX2)
        return (vnni & 1) && CPUD_CAN_AVXVNNI ? &cpud_qops_avx2_vnni : &cpud_qops_avx2;
    return &cpud_qops_scalar;
}

const cpud_qops *cpud_qops_for(int isa, int flags) { return qops_for(isa, flags); }

/* The amx tier exists only where AMX-BF16 tile data is granted (dispatch.c). */
static int bf16_tiles(int isa, int flags) {
    return CPUD_CAN_AMX && isa >= CPUD_ISA_AMX && cpud_ops_for(isa) &&
           !(flags & (CPUD_QUANT_NO_AMX | CPUD_QUANT_NO_AMX_BF16));
}

static int dt_ok(int dt) { return dt == CPUD_F32 || dt == CPUD_BF16; }

static int part_ok(int qtype, intptr_t qs, intptr_t sc, int64_t N, int64_t K) {
    return qtype >= 0 && qtype < Q_TYPES && qs && qs % 64 == 0 && sc && N >= 1 && K >= 1 &&
           K % q_fmt[qtype].bs == 0;
}

static int x_ok(intptr_t x, int x_dtype, int64_t x_stride, intptr_t out, int out_dtype,
                int64_t out_stride, int64_t M, int64_t N, int64_t K) {
    return dt_ok(x_dtype) && dt_ok(out_dtype) && x && out && M >= 0 &&
           (M <= 1 || (x_stride >= K && out_stride >= N));
}

/* x [M][K] -> a: int8 blocks in the calling thread's scratch, padded to ops->mrows rows. */
static int quantize_x(const cpud_qops *ops, intptr_t x, int x_dtype, int64_t x_stride, int64_t M,
                      int64_t K, qact *a) {
    static _Thread_local void *scratch;
    static _Thread_local size_t cap;
    const int64_t mp = (M + ops->mrows - 1) / ops->mrows * ops->mrows;
    const size_t nq = (size_t)(mp * K + 63) / 64 * 64, nd = (size_t)(mp * K / 32) * sizeof(float);
    char *buf = q_grow(&scratch, &cap, nq + nd + (size_t)(mp * K / 16) * sizeof(int32_t));
    if (!buf) return CPUD_ENOMEM;
    *a = (qact){(const int8_t *)buf, (const float *)(buf + nq), (const int32_t *)(buf + nq + nd), K};
    ops->quantize((const void *)x, x_dtype, x_stride, M, K, (int8_t *)a->q, (float *)a->d,
                  (int32_t *)a->s);
    if (mp > M) {
        memset((int8_t *)a->q + M * K, 0, (size_t)((mp - M) * K));
        memset((float *)a->d + M * (K / 32), 0, (size_t)((mp - M) * (K / 32)) * sizeof(float));
        memset((int32_t *)a->s + M * (K / 16), 0, (size_t)((mp - M) * (K / 16)) * sizeof(int32_t));
    }
    return CPUD_OK;
}

int cpud_quant_gemm(int isa, int flags, int qtype, intptr_t x, int x_dtype, int64_t x_stride,
                    intptr_t qs, intptr_t sc, intptr_t bias, intptr_t out, int out_dtype,
                    int64_t out_stride, int64_t M, int64_t N, int64_t K) {
    const cpud_qops *ops = qops_for(isa, flags);
    if (!ops) return CPUD_EISA;
    if (!part_ok(qtype, qs, sc, N, K) || !x_ok(x, x_dtype, x_stride, out, out_dtype, out_stride, M, N, K))
        return CPUD_EARG;
    if (M == 0) return CPUD_OK;
#if CPUD_CAN_AMX
    if (bf16_tiles(isa, flags) && M >= q_fmt[qtype].bf16_min_m &&
        cpud_qgemm_amx_bf16(qtype, (const void *)x, x_dtype, x_stride, (const uint8_t *)qs,
                            (const uint8_t *)sc, (const float *)bias, (void *)out, out_dtype,
                            out_stride, M, N, K) == CPUD_OK)
        return CPUD_OK; /* else (no memory for its scratch) the int8 kernels, which need less */
#endif
    qact a;
    const int rc = quantize_x(ops, x, x_dtype, x_stride, M, K, &a);
    if (rc) return rc;
    ops->gemm(qtype, &a, (const uint8_t *)qs, (const uint8_t *)sc, (const float *)bias,
              (void *)out, out_dtype, out_stride, M, N);
    return CPUD_OK;
}

int cpud_quant_linear(int isa, int flags, const cpud_qlinear *q, intptr_t x, int x_dtype,
                      int64_t x_stride, intptr_t out, int out_dtype, int64_t out_stride,
                      int64_t M, int64_t K) {
    const cpud_qops *ops = qops_for(isa, flags);
    if (!ops) return CPUD_EISA;
    if (!q || q->parts < 1 || q->parts > CPUD_QPARTS_MAX) return CPUD_EARG;
    qpart p[CPUD_QPARTS_MAX];
    int64_t N = 0;
    for (int i = 0; i < q->parts; i++) {
        if (!part_ok(q->qtype[i], q->qs[i], q->sc[i], q->n[i], K)) return CPUD_EARG;
        p[i] = (qpart){q->qtype[i], (const uint8_t *)q->qs[i], (const uint8_t *)q->sc[i],
                       (const float *)q->bias[i], q->n[i], N};
        N += q->n[i];
    }
    if (!x_ok(x, x_dtype, x_stride, out, out_dtype, out_stride, M, N, K)) return CPUD_EARG;
    if (M == 0) return CPUD_OK;
    if (ops == &cpud_qops_amx && M >= 16) { /* tiles: each part its own call */
        for (int i = 0; i < q->parts; i++) {
            const int rc = cpud_quant_gemm(isa, flags, p[i].qt, x, x_dtype, x_stride, q->qs[i],
                                           q->sc[i], q->bias[i],
                                           out + p[i].col * dtype_size(out_dtype), out_dtype,
                                           out_stride, M, p[i].N, K);
            if (rc) return rc;
        }
        return CPUD_OK;
    }
    qact a;
    const int rc = quantize_x(ops, x, x_dtype, x_stride, M, K, &a);
    if (rc) return rc;
    ops->gemm_parts(p, (int)q->parts, &a, (void *)out, out_dtype, out_stride, M);
    return CPUD_OK;
}

const char *cpud_quant_kernel(int isa, int flags) {
    const cpud_qops *ops = qops_for(isa, flags);
    if (ops && bf16_tiles(isa, flags))
        return ops == &cpud_qops_amx ? "amx amx-int8+bf16" : "amx amx-bf16";
    return ops ? ops->name : "none";
}

double cpud_quant_compute_probe(int isa, int flags, int64_t iters) {
    const cpud_qops *ops = qops_for(isa, flags);
    if (!ops || iters < 0) return -1.0;
    float sink = 0.0f;
    return ops->probe(iters, &sink);
}

int cpud_quant_bf16_min_m(int isa, int flags, int qtype) {
    if (!qops_for(isa, flags) || qtype < 0 || qtype >= Q_TYPES) return -1;
    return bf16_tiles(isa, flags) ? q_fmt[qtype].bf16_min_m : 0;
}

int cpud_quant_format(int qtype, int *ggml_type, int *block_values, int *block_bytes,
                      int *qbytes, int *sbytes) {
    if (qtype < 0 || qtype >= Q_TYPES || !ggml_type || !block_values || !block_bytes || !qbytes ||
        !sbytes)
        return CPUD_EARG;
    *ggml_type = q_fmt[qtype].ggml_type;
    *block_values = q_fmt[qtype].bs;
    *block_bytes = q_fmt[qtype].block_bytes;
    *qbytes = q_fmt[qtype].qbytes;
    *sbytes = q_fmt[qtype].sbytes;
    return CPUD_OK;
}
