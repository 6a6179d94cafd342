/* cpud_dequant_rows: rows of a table kept in GGUF blocks, dequantized to f32 or bf16 (an
 * embedding lookup).  Scalar code: a row is a few thousand values.  Every value is computed with
 * the operations of gguf-py's numpy dequantize, in the same order and in f32 (the block layouts
 * are ggml-common.h's), so the f32 rows equal gguf.quants.dequantize bit for bit. */
#include "common.h"

#define QK_K 256

static float fp16_to_f32(const uint8_t *p) {
    const uint32_t h = (uint32_t)p[0] | (uint32_t)p[1] << 8;
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | man << 13;
    } else if (exp) {
        bits = sign | (exp + 112) << 23 | man << 13;
    } else {
        /* zero or subnormal: man * 2^-24, exact in f32 */
        float f = (float)man * 0x1p-24f;
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* ggml_e8m0_to_fp32_half as gguf-py computes it: 2^(e - 128), with e < 2 as f32 subnormals. */
static float e8m0_half_bits(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Value j of a 32-value block whose 16 bytes hold values j (low nibbles) and j + 16 (high). */
static inline int nibble32(const uint8_t *qs, int j) {
    return j < 16 ? qs[j] & 0x0f : qs[j - 16] >> 4;
}

static void dq_q8_0(const uint8_t *b, float *y) {
    const float d = fp16_to_f32(b);
    for (int j = 0; j < 32; j++) y[j] = d * (float)(int8_t)b[2 + j];
}

static void dq_q4_0(const uint8_t *b, float *y) {
    const float d = fp16_to_f32(b);
    for (int j = 0; j < 32; j++) y[j] = d * (float)(nibble32(b + 2, j) - 8);
}

static void dq_q4_1(const uint8_t *b, float *y) {
    const float d = fp16_to_f32(b), m = fp16_to_f32(b + 2);
    for (int j = 0; j < 32; j++) y[j] = d * (float)nibble32(b + 4, j) + m;
}

static inline uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void dq_q5_0(const uint8_t *b, float *y) {
    const float d = fp16_to_f32(b);
    const uint32_t qh = le32(b + 2);
    for (int j = 0; j < 32; j++)
        y[j] = d * (float)((nibble32(b + 6, j) | (int)((qh >> j) & 1) << 4) - 16);
}

static void dq_q5_1(const uint8_t *b, float *y) {
    const float d = fp16_to_f32(b), m = fp16_to_f32(b + 2);
    const uint32_t qh = le32(b + 4);
    for (int j = 0; j < 32; j++)
        y[j] = d * (float)(nibble32(b + 8, j) | (int)((qh >> j) & 1) << 4) + m;
}

/* The 6-bit scale and min of sub-block s (0..7) from a K-quant's 12 packed bytes. */
static void k_scale_min(const uint8_t *s12, int s, int *sc, int *mn) {
    if (s < 4) {
        *sc = s12[s] & 0x3f;
        *mn = s12[s + 4] & 0x3f;
    } else {
        *sc = (s12[s + 4] & 0x0f) | ((s12[s - 4] >> 2) & 0x30);
        *mn = (s12[s + 4] >> 4) | ((s12[s] >> 2) & 0x30);
    }
}

/* Q4_K: d, dmin, 12 scale bytes, 128 bytes of quants (32 bytes per pair of sub-blocks).
 * Q5_K (qh): the same fields with 32 bytes of high bits before the quants (bit s of byte l:
 * value s * 32 + l). */
static void dq_k45(const uint8_t *b, float *y, const uint8_t *qh) {
    const float d = fp16_to_f32(b), dmin = fp16_to_f32(b + 2);
    const uint8_t *qs = qh ? b + 48 : b + 16;
    for (int s = 0; s < 8; s++) {
        int sc, mn;
        k_scale_min(b + 4, s, &sc, &mn);
        const float ds = d * (float)sc, dm = dmin * (float)mn;
        const uint8_t *q = qs + (s / 2) * 32;
        const int shift = (s % 2) * 4;
        for (int l = 0; l < 32; l++) {
            const int high = qh ? ((qh[l] >> s) & 1) << 4 : 0;
            y[s * 32 + l] = ds * (float)(((q[l] >> shift) & 0x0f) | high) - dm;
        }
    }
}

static void dq_q4_k(const uint8_t *b, float *y) { dq_k45(b, y, NULL); }

static void dq_q5_k(const uint8_t *b, float *y) { dq_k45(b, y, b + 16); }

/* Q6_K: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (one per 16 values), d. */
static void dq_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *scales = (const int8_t *)(b + 192);
    const float d = fp16_to_f32(b + 208);
    for (int v = 0; v < QK_K; v++) {
        const int g = v / 128, r = v % 128;
        const int lo = (ql[g * 64 + r % 64] >> (4 * (r / 64))) & 0x0f;
        const int hi = (qh[g * 32 + r % 32] >> (2 * (r / 32))) & 0x03;
        const float ds = d * (float)scales[v / 16];
        y[v] = ds * (float)((lo | hi << 4) - 32);
    }
}

/* MXFP4: an E8M0 scale byte, then 16 bytes of E2M1 codes (doubled values, halved scale). */
static void dq_mxfp4(const uint8_t *b, float *y) {
    static const int8_t kvalues[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    const float d = e8m0_half_bits(b[0]);
    for (int j = 0; j < 32; j++) y[j] = d * (float)kvalues[nibble32(b + 1, j)];
}

typedef struct {
    int ggml_type, block_values, block_bytes;
    void (*block)(const uint8_t *b, float *y);
} dq_format;

static const dq_format DQ_FORMATS[] = {
    {8, 32, 34, dq_q8_0},      {2, 32, 18, dq_q4_0},       {3, 32, 20, dq_q4_1},
    {6, 32, 22, dq_q5_0},      {7, 32, 24, dq_q5_1},       {12, QK_K, 144, dq_q4_k},
    {13, QK_K, 176, dq_q5_k},  {14, QK_K, 210, dq_q6_k},   {39, 32, 17, dq_mxfp4},
};

static const dq_format *dq_format_of(int ggml_type) {
    for (size_t i = 0; i < sizeof DQ_FORMATS / sizeof DQ_FORMATS[0]; i++)
        if (DQ_FORMATS[i].ggml_type == ggml_type) return &DQ_FORMATS[i];
    return NULL;
}

int cpud_dequant_rows_format(int ggml_type, int *block_values, int *block_bytes) {
    const dq_format *f = dq_format_of(ggml_type);
    if (!f) return CPUD_EARG;
    if (block_values) *block_values = f->block_values;
    if (block_bytes) *block_bytes = f->block_bytes;
    return CPUD_OK;
}

int cpud_dequant_rows(int ggml_type, intptr_t table, int64_t n_rows, int64_t row_stride,
                      int64_t cols, intptr_t ids, int64_t n_ids, intptr_t out, int out_dtype) {
    const dq_format *f = dq_format_of(ggml_type);
    if (!f || (out_dtype != CPUD_F32 && out_dtype != CPUD_BF16) || n_rows < 0 || n_ids < 0 ||
        cols < 1 || cols % f->block_values || row_stride < cols / f->block_values * f->block_bytes)
        return CPUD_EARG;
    if (n_ids == 0) return CPUD_OK;
    if (!table || !ids || !out) return CPUD_EARG;
    const int64_t *id = (const int64_t *)ids;
    for (int64_t i = 0; i < n_ids; i++)
        if (id[i] < 0 || id[i] >= n_rows) return CPUD_EARG;
    const int64_t blocks = cols / f->block_values;
    CPUD_PAR_FOR(cpud_par_ok(n_ids * cols, n_ids), i, n_ids,
        const uint8_t *row = (const uint8_t *)table + id[i] * row_stride;
        float y[QK_K];
        for (int64_t k = 0; k < blocks; k++) {
            f->block(row + k * f->block_bytes, y);
            const int64_t at = i * cols + k * f->block_values;
            if (out_dtype == CPUD_F32)
                memcpy((float *)out + at, y, sizeof(float) * (size_t)f->block_values);
            else
                for (int j = 0; j < f->block_values; j++)
                    ((uint16_t *)out)[at + j] = f32_to_bf16(y[j]);
        }
        );
    return CPUD_OK;
}
