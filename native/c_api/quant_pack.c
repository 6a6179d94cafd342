/* cpud_quant_pack: GGUF blocks of W[N][K] -> the packed groups cpud_quant_gemm reads (quant.h,
 * the layout comments of cpud_native.h and quant_kernels.h).  Per group of 16 rows and per GGUF
 * block, the 16 rows' blocks are decoded into unsigned quants and scale fields, then written:
 *
 *   quants, per 32 values j = 4 t + i of a row r (t: dword 0..7, i: byte in it):
 *     Q8_0:  byte t * 64 + r * 4 + i = q                                        (512 bytes)
 *     4-bit: byte c * 64 + r * 4 + i = low nibble of dword 2c | that of 2c + 1 << 4  (256)
 *     Q5_K:  then byte 256 + r * 4 + i = bit 4 of dword t's q at bit t              (+64)
 *     Q6_K:  then byte 256 + a * 64 + r * 4 + i = bits 4-5 of dword 4a + b at bits 2b  (+128)
 *   scales, rows innermost: an fp16 field at 2 r, a byte array's entry e at e * 16 + r, fields
 *     in the order Q8_0/Q4_0: d; Q4_1: d, m; Q4_K/Q5_K: d, dmin, 8 scales, 8 mins (6-bit,
 *     unpacked); Q6_K: d, 16 int8 scales; MXFP4: the E8M0 byte.
 *
 * Quants are unsigned: Q8_0's int8 + 128.  Rows past N read as all-zero blocks (Q8_0's then
 * pack as 0x80).  Plain C, any ISA; one parallel region over every matrix's groups. */
#include "quant.h"

#define QK_MAX 256 /* values per block, at most */

/* The 16 rows' quants of one block ([r][v], unsigned) and its scale fields. */
typedef struct qdec {
    uint8_t q[QR][QK_MAX];
    uint8_t h16[2][QR][2]; /* fp16 fields: d, then dmin / m            */
    uint8_t u8[2][QR][16]; /* byte arrays: K-quant scales, mins; Q6_K scales; MXFP4 e */
} qdec;

/* 2 * half values from half bytes: v (low nibbles), then half + v (high nibbles). */
static inline void nibbles(const uint8_t *qs, int half, uint8_t *q) {
    for (int v = 0; v < half; v++) q[v] = qs[v] & 0x0f;
    for (int v = 0; v < half; v++) q[half + v] = qs[v] >> 4;
}

static void dec_b32(int qt, const uint8_t *b, int r, qdec *d) {
    memcpy(d->h16[0][r], b, 2);
    if (qt == CPUD_Q8_0) {
        for (int v = 0; v < 32; v++) d->q[r][v] = b[2 + v] ^ 0x80;
    } else if (qt == CPUD_MXFP4) {
        d->u8[0][r][0] = b[0];
        nibbles(b + 1, 16, d->q[r]);
    } else {
        if (qt == CPUD_Q4_1) memcpy(d->h16[1][r], b + 2, 2);
        nibbles(b + (qt == CPUD_Q4_1 ? 4 : 2), 16, d->q[r]);
    }
}

/* Q4_K / Q5_K: d, dmin, 12 bytes of 6-bit scales and mins, (Q5_K: 32 bytes of high bits, bit s
 * of byte l for value 32 s + l), 128 bytes of quants (per 64 values: 32 bytes, low then high). */
static void dec_k45(int qt, const uint8_t *b, int r, qdec *d) {
    const uint8_t *s = b + 4, *qs = qt == CPUD_Q5_K ? b + 48 : b + 16;
    memcpy(d->h16[0][r], b, 2);
    memcpy(d->h16[1][r], b + 2, 2);
    for (int j = 0; j < 4; j++) {
        d->u8[0][r][j] = s[j] & 63;
        d->u8[1][r][j] = s[j + 4] & 63;
        d->u8[0][r][j + 4] = (s[j + 8] & 0x0f) | (s[j] >> 6) << 4;
        d->u8[1][r][j + 4] = (s[j + 8] >> 4) | (s[j + 4] >> 6) << 4;
    }
    for (int c = 0; c < 4; c++) nibbles(qs + c * 32, 32, d->q[r] + c * 64);
    if (qt == CPUD_Q5_K)
        for (int t = 0; t < 8; t++)
            for (int l = 0; l < 32; l++) d->q[r][t * 32 + l] |= ((b[16 + l] >> t) & 1) << 4;
}

/* Q6_K: 128 bytes of low nibbles (per 128 values: 64 bytes, low then high), 64 bytes of 2-bit
 * highs (per 128 values: 32 bytes, bits 2 s for value 32 s + l), 16 int8 scales, d. */
static void dec_q6k(const uint8_t *b, int r, qdec *d) {
    memcpy(d->h16[0][r], b + 208, 2);
    memcpy(d->u8[0][r], b + 192, 16);
    for (int h = 0; h < 2; h++) {
        uint8_t *q = d->q[r] + h * 128;
        nibbles(b + h * 64, 64, q);
        const uint8_t *qh = b + 128 + h * 32;
        for (int t = 0; t < 4; t++)
            for (int l = 0; l < 32; l++) q[t * 32 + l] |= ((qh[l] >> (2 * t)) & 3) << 4;
    }
}

static inline uint32_t dword(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The quants of 32 values from j0 of every row -> out (per format, as at the top); the 4 bytes
 * of a dword move together. */
static void put_quants(int qt, const qdec *d, int j0, uint8_t *out) {
    if (qt == CPUD_Q8_0) {
        for (int t = 0; t < 8; t++)
            for (int r = 0; r < QR; r++) memcpy(out + t * 64 + r * 4, &d->q[r][j0 + 4 * t], 4);
        return;
    }
    for (int c = 0; c < 4; c++)
        for (int r = 0; r < QR; r++) {
            const uint32_t lo = dword(&d->q[r][j0 + 8 * c]), hi = dword(&d->q[r][j0 + 8 * c + 4]);
            const uint32_t v = (lo & 0x0f0f0f0fu) | (hi & 0x0f0f0f0fu) << 4;
            memcpy(out + c * 64 + r * 4, &v, 4);
        }
    if (qt == CPUD_Q5_K) {
        for (int r = 0; r < QR; r++) {
            uint32_t bits = 0;
            for (int t = 0; t < 8; t++)
                bits |= (dword(&d->q[r][j0 + 4 * t]) >> 4 & 0x01010101u) << t;
            memcpy(out + 256 + r * 4, &bits, 4);
        }
    } else if (qt == CPUD_Q6_K) {
        for (int a = 0; a < 2; a++)
            for (int r = 0; r < QR; r++) {
                uint32_t bits = 0;
                for (int t = 0; t < 4; t++)
                    bits |= (dword(&d->q[r][j0 + 16 * a + 4 * t]) >> 4 & 0x03030303u) << (2 * t);
                memcpy(out + 256 + a * 64 + r * 4, &bits, 4);
            }
    }
}

/* The scale fields of one block -> out [sbytes], rows innermost. */
static void put_scales(int qt, const qdec *d, uint8_t *out) {
    const int halves = qt == CPUD_Q4_1 || qt == CPUD_Q4_K || qt == CPUD_Q5_K ? 2
                       : qt == CPUD_MXFP4                                    ? 0
                                                                             : 1;
    const int arrays = qt == CPUD_Q4_K || qt == CPUD_Q5_K ? 2 : qt == CPUD_Q6_K || qt == CPUD_MXFP4;
    const int entries = qt == CPUD_Q6_K ? 16 : qt == CPUD_MXFP4 ? 1 : 8;
    for (int f = 0; f < halves; f++, out += 2 * QR)
        for (int r = 0; r < QR; r++) memcpy(out + 2 * r, d->h16[f][r], 2);
    for (int f = 0; f < arrays; f++, out += entries * QR)
        for (int e = 0; e < entries; e++)
            for (int r = 0; r < QR; r++) out[e * QR + r] = d->u8[f][r][e];
}

int cpud_quant_pack(int qtype, intptr_t rows, int64_t E, int64_t N, int64_t K, intptr_t qs,
                    intptr_t sc, int64_t *nan_scales) {
    if (qtype < 0 || qtype >= Q_TYPES || E < 1 || N < 1 || K < 1 || !rows || !qs || !sc ||
        !nan_scales)
        return CPUD_EARG;
    const qformat *f = &q_fmt[qtype];
    if (K % f->bs) return CPUD_EARG;
    const intptr_t *row_at = (const intptr_t *)rows;
    for (int64_t i = 0; i < E * N; i++)
        if (!row_at[i]) return CPUD_EARG;
    const int64_t groups = (N + QR - 1) / QR, nb = K / f->bs, items = E * groups;
    const int qb32 = f->qbytes / (f->bs / 32), mxfp4 = qtype == CPUD_MXFP4;
    static const uint8_t zero_block[QK_MAX];
    int64_t nans = 0;
    /* One region over every expert's groups: many small regions would each wait for the
     * slowest thread, which on a busy machine is a scheduler time slice per region. */
#pragma omp parallel for schedule(static) reduction(+ : nans) if (cpud_par_ok(E * N * K, items))
    for (int64_t it = 0; it < items; it++) {
        const int64_t e = it / groups, g = it % groups, at = e * groups * nb + g * nb;
        qdec d;
        const uint8_t *row[QR];
        for (int r = 0; r < QR; r++) {
            const int64_t n = g * QR + r;
            row[r] = n < N ? (const uint8_t *)row_at[e * N + n] : NULL;
        }
        for (int64_t b = 0; b < nb; b++) {
            for (int r = 0; r < QR; r++) {
                const uint8_t *blk = row[r] ? row[r] + b * f->block_bytes : zero_block;
                if (f->family == QF_k45)
                    dec_k45(qtype, blk, r, &d);
                else if (f->family == QF_q6k)
                    dec_q6k(blk, r, &d);
                else
                    dec_b32(qtype, blk, r, &d);
                if (mxfp4) nans += blk[0] == 0xff;
            }
            uint8_t *q_out = (uint8_t *)qs + (at + b) * f->qbytes;
            for (int j = 0; j < f->bs / 32; j++) put_quants(qtype, &d, 32 * j, q_out + j * qb32);
            put_scales(qtype, &d, (uint8_t *)sc + (at + b) * f->sbytes);
        }
    }
    *nan_scales = nans;
    return CPUD_OK;
}
