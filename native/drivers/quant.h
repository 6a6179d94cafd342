/* Internals shared by the quantized-GEMM kernels (quant_*.c): the packed layout of each type,
 * the int8 activations, the kernel table of one variant, and the output store.  No target
 * attributes here. */
#ifndef CPUD_QUANT_H
#define CPUD_QUANT_H

#include <stdlib.h>

#include "common.h"
#include "task_steal.h"

/* The avxvnni target attribute exists from gcc 11 and clang 12. */
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define CPUD_CAN_AVXVNNI 1
#else
#define CPUD_CAN_AVXVNNI 0
#endif

#define QR CPUD_QROWS
/* Rows of x one task takes (the weights of a group stay in L1/L2 across them). */
#define QMC 64

/* Kernel variants, lowest first. */
enum { QV_SCALAR, QV_AVX2, QV_AVX2_VNNI, QV_AVX512, QV_AVX512_VNNI, QV_COUNT };

/* x quantized: per row, blocks of 32 int8 with an fp32 scale and int32 sums of each 16. */
typedef struct qact {
    const int8_t *q;  /* [M][K]     */
    const float *d;   /* [M][K/32]  */
    const int32_t *s; /* [M][K/16]  */
    int64_t K;
} qact;

/* The kernel families of quant_formats.h (quant_kernels.h's blk_b32, blk_k45, blk_q6k,
 * blk_e2m1). */
enum { QF_b32, QF_k45, QF_q6k, QF_e2m1 };

/* MXFP4: a 4-bit E2M1 code's value doubled (the code's index: sign bit 3), plus E2M1_OFF so
 * that every weight is an unsigned byte for the u8 x s8 dots; a block's E8M0 exponent e scales
 * the doubled values by 2^(e - 128) (half of the OCP scale 2^(e - 127)). */
#define E2M1_OFF 12
#define E2M1_PLUS_OFF 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0

/* 2^(e - 128) for an E8M0 byte, exact (e < 2: a denormal); 0xff gives 2^127, as ggml's
 * ggml_e8m0_to_fp32_half (pack_quantized refuses that byte: OCP MX's NaN). */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* A qtype's format (quant_formats.h): its GGUF type id, k and bytes per GGUF block, bytes of
 * packed quants and of scales per block of 16 rows, its family, k per weight scale, whether
 * weights have mins, and the rows of x from which the amx tier runs the bf16-tile kernel (below
 * it, AMX-INT8 / VNNI). */
typedef struct qformat {
    int ggml_type, bs, block_bytes, qbytes, sbytes, family, kt, mins, bf16_min_m;
} qformat;

#define CPUD_KERNEL_FORMAT(name, ggml_type, block_values, block_bytes, code, qbytes, sbytes,       \
                           family, scale_values, mins, bf16_min_m)                                 \
    [code] = {ggml_type,   block_values, block_bytes, qbytes,    sbytes,                           \
              QF_##family, scale_values, mins,        bf16_min_m},
/* [qtype] */
static const qformat q_fmt[] = {
#include "quant_formats.h"
};
#define Q_TYPES ((int)(sizeof q_fmt / sizeof q_fmt[0]))

/* cpud_qlinear's parts, at most */
#define CPUD_QPARTS_MAX 3

/* One part of a linear: output columns [col, col + N) from weights of type qt. */
typedef struct qpart {
    int qt;
    const uint8_t *qs, *sc;
    const float *bias; /* [N] f32 or NULL */
    int64_t N, col;
} qpart;

/* The tasks of a GEMM over np parts with M rows of x: per part, its groups of QR w rows times
 * chunks of QMC x rows, parts one after another.  first[i]: part i's first task, first[np]: the
 * count (returned); task t of part i is group (t - first[i]) / nmc, chunk (t - first[i]) % nmc
 * with nmc = q_chunks(M). */
static inline int64_t q_chunks(int64_t M) { return (M + QMC - 1) / QMC; }

static inline int64_t q_part_tasks(const qpart *p, int np, int64_t M, int64_t *first) {
    const int64_t nmc = q_chunks(M);
    first[0] = 0;
    for (int i = 0; i < np; i++) first[i + 1] = first[i] + (p[i].N + QR - 1) / QR * nmc;
    return first[np];
}

/* The part that task t of q_part_tasks' numbering belongs to. */
static inline int q_task_part(const int64_t *first, int64_t task) {
    int i = 0;
    while (task >= first[i + 1]) i++;
    return i;
}

typedef struct cpud_qops {
    const char *name;
    /* x: [M][K] rows xs apart, dtype dt -> a's buffers */
    void (*quantize)(const void *x, int dt, int64_t xs, int64_t M, int64_t K, int8_t *q,
                     float *d, int32_t *s);
    /* out[M][N] (row stride os, dtype odt) = a @ W^T + bias (bias: [N] f32 or NULL) */
    void (*gemm)(int qtype, const qact *a, const uint8_t *qs, const uint8_t *sc,
                 const float *bias, void *out, int odt, int64_t os, int64_t M, int64_t N);
    /* the vector kernels over np parts side by side in out's columns, one parallel region */
    void (*gemm_parts)(const qpart *p, int np, const qact *a, void *out, int odt, int64_t os,
                       int64_t M);
    /* gemm_parts without a parallel region: thread tid of nth of the caller's team computes
     * its share, and with st (NULL: none) takes tasks from the others' shares once it is done;
     * every thread of the team calls it once */
    void (*gemm_parts_part)(const qpart *p, int np, const qact *a, void *out, int odt,
                            int64_t os, int64_t M, int tid, int nth, const task_steal *st);
    double (*probe)(int64_t iters, float *sink);
    /* out rows [m0, m1) x weight group g (its 16 rows of N; qs, sc at the weights' first
     * group) on the calling thread, no parallel region: a share of a caller's work list */
    void (*rows)(int qtype, const qact *a, const uint8_t *qs, const uint8_t *sc,
                 const float *bias, void *out, int odt, int64_t os, int64_t m0, int64_t m1,
                 int64_t g, int64_t N);
    int mrows; /* gemm reads x's buffers in whole blocks of this many rows (pad rows zero) */
} cpud_qops;

/* The variant cpud_quant_gemm runs for (isa, flags), or NULL (quant_api.c). */
const cpud_qops *cpud_qops_for(int isa, int flags);

extern const cpud_qops cpud_qops_scalar, cpud_qops_avx2, cpud_qops_avx2_vnni, cpud_qops_avx512,
    cpud_qops_avx512_vnni, cpud_qops_amx;

#if CPUD_CAN_AMX
/* quant_amx.c: one group's quants over all K as signed int8 B tiles [K/4][64] (16 rows x 4 k
 * per 64 bytes) with per-sub-block fp32 scales sw and mins mw ([K/kt][16], kt 32; Q6_K 16): the
 * weight is sw * b + mw.  cpud_qamx_store: q_store for res [mr][16] in whole vectors. */
void cpud_qamx_unpack(int qt, const uint8_t *q, const uint8_t *s, int64_t nb, int8_t *b,
                      float *sw, float *mw);
void cpud_qamx_store(const float *res, int mr, int64_t m0, int64_t g, int64_t N,
                     const float *bias, void *out, int odt, int64_t os);
/* quant_amx_bf16.c: out = x @ W^T on AMX-BF16 tiles, weights dequantized to bf16 per group;
 * CPUD_OK, or CPUD_ENOMEM (nothing usable written: run another kernel). */
int cpud_qgemm_amx_bf16(int qt, const void *x, int dt, int64_t xs, const uint8_t *qs,
                        const uint8_t *sc, const float *bias, void *out, int odt, int64_t os,
                        int64_t M, int64_t N, int64_t K);
#endif

/* A thread's scratch (*buf, *cap: its _Thread_local slot) of at least n bytes, 64-aligned,
 * kept for the thread's next call; NULL when out of memory. */
static inline void *q_grow(void **buf, size_t *cap, size_t n) {
    if (n <= *cap) return *buf;
    free(*buf);
    const size_t want = (n + (n >> 2) + 63) / 64 * 64;
    *buf = aligned_alloc(64, want);
    *cap = *buf ? want : 0;
    return *buf;
}

static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t u;
    if (e == 0) {
        const float f = ldexpf((float)m, -24);
        return sign ? -f : f;
    }
    u = e == 31 ? (0x7f800000u | m << 13) : ((e + 112) << 23 | m << 13);
    u |= sign;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* res: [mr][16] rows m0.. of x, output rows g*16..; writes the rows below N. */
static inline void q_store(const float *res, int mr, int64_t m0, int64_t g, int64_t N,
                           const float *bias, void *out, int odt, int64_t os) {
    const int64_t n0 = g * QR, nr = N - n0 < QR ? N - n0 : QR;
    for (int m = 0; m < mr; m++)
        for (int64_t r = 0; r < nr; r++)
            st1(out, (m0 + m) * os + n0 + r, res[m * QR + r] + (bias ? bias[n0 + r] : 0.0f), odt);
}

#endif
