/* Quantized GEMM, AMX-INT8 variant: tdpbssd tiles from 16 rows of x up, the AVX512-VNNI kernels
 * below that (and for every GEMV).
 *
 * C[16 x rows][16 w rows] (int32, tiles 0-3) = A (x: 16 rows of int8, KT bytes each, tiles 4-5)
 * . B (weights: KT/4 rows of 16 w rows x 4 k, tiles 6-7).  The packed layout already is B's
 * (4 consecutive quants per dword, 16 rows per 64 bytes): a task unpacks one group of 16 w rows
 * over all of K into a signed B buffer once (Q8_0 - 128, Q4_0 - 8, Q6_K - 32, nibbles and high
 * bits joined, MXFP4 codes to their doubled E2M1 values) with the fp32 scales per sub-block,
 * then runs it against every 16-row tile of its chunk of x.  KT is the k one scale covers (32;
 * Q6_K 16): per KT, one tile product, then
 *   acc[m] += cvt(C[m]) * (w_scale * x_scale[m]) + w_min * (x_scale[m] * x_sum[m])
 * in fp32 (w_min: Q4_1's m, the K-quants' -dmin mn).  x's scales and scaled sums are laid out
 * per 16-row tile once per call. */
#include "quant.h"

#if CPUD_CAN_AMX
#define QUANT_VNNI 1
#include "quant_simd_avx512.h"

#include "quant_kernels.h"

#define ATGT                                                                                       \
    __attribute__((target("avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,"      \
                          "amx-tile,amx-int8")))
#define AMX_MIN_M 16
#define AMC 256 /* rows of x per task: whole tiles, a chunk stays in L2 */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} qamx_cfg;

/* Tiles 0-3: C; 4-5: A (KT bytes per row); 6-7: B (KT/4 rows). */
static ATGT void amx_config(int kt) {
    qamx_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = t >= 6 ? (uint8_t)(kt / 4) : 16;
        c.colsb[t] = t == 4 || t == 5 ? (uint16_t)kt : 64;
    }
    _tile_loadconfig(&c);
}

/* One group's weights for tile products: B [nsub][KT/4][64] i8; per sub-block the 16 rows'
 * scales sw and mins mw (fp32, 0 where the type has none). */
typedef struct {
    int8_t *b;
    float *sw, *mw;
} qgroup;

static ALWAYS_INLINE ATGT void st_b(int8_t *p, __m512i v) { _mm512_store_si512((void *)p, v); }

static ATGT void unpack_group(int qt, const uint8_t *q, const uint8_t *s, int64_t nb,
                              const qgroup *g) {
    const __m512i c128 = _mm512_set1_epi8((char)0x80), c8 = _mm512_set1_epi8(8);
    const __m512i c32 = _mm512_set1_epi8(32);
    const __m512 z = _mm512_setzero_ps();
    const __m512i c_e2m1 = _mm512_set1_epi8(E2M1_OFF);
    for (int64_t b = 0; b < nb; b++) {
        if (q_fmt[qt].family == QF_e2m1) {
            int8_t *o = g->b + b * 512;
            _mm512_store_ps(g->sw + b * 16, fv_e8m0(s + b * q_fmt[qt].sbytes));
            _mm512_store_ps(g->mw + b * 16, z);
            const uint8_t *qb = q + b * q_fmt[qt].qbytes;
            for (int c = 0; c < 4; c++) {
                const qv w = qv_ld(qb + c * 64);
                st_b(o + 2 * c * 64, _mm512_sub_epi8(qv_e2m1(qv_lo(w)), c_e2m1));
                st_b(o + (2 * c + 1) * 64, _mm512_sub_epi8(qv_e2m1(qv_hi(w)), c_e2m1));
            }
            continue;
        }
        if (q_fmt[qt].family == QF_b32) {
            const uint8_t *sb = s + b * q_fmt[qt].sbytes;
            int8_t *o = g->b + b * 512;
            _mm512_store_ps(g->sw + b * 16, fv_h16((const uint16_t *)sb));
            const fv mn = q_fmt[qt].mins ? fv_h16((const uint16_t *)(sb + 32)) : z;
            _mm512_store_ps(g->mw + b * 16, mn);
            const uint8_t *qb = q + b * q_fmt[qt].qbytes;
            for (int c = 0; c < (qt == CPUD_Q8_0 ? 8 : 4); c++) {
                if (qt == CPUD_Q8_0) {
                    st_b(o + c * 64, _mm512_xor_si512(qv_ld(qb + c * 64), c128));
                    continue;
                }
                const qv w = qv_ld(qb + c * 64);
                const qv lo = qv_lo(w), hi = qv_hi(w);
                st_b(o + 2 * c * 64, qt == CPUD_Q4_0 ? _mm512_sub_epi8(lo, c8) : lo);
                st_b(o + (2 * c + 1) * 64, qt == CPUD_Q4_0 ? _mm512_sub_epi8(hi, c8) : hi);
            }
            continue;
        }
        const uint8_t *sb = s + b * q_fmt[qt].sbytes;
        const fv d = fv_h16((const uint16_t *)sb);
        for (int j = 0; j < 8; j++) {
            int8_t *o = g->b + (b * 8 + j) * 512;
            if (q_fmt[qt].family == QF_q6k) {
                const uint8_t *qj = q + b * q_fmt[qt].qbytes + j * 384;
                for (int h = 0; h < 2; h++) {
                    const int u = (int)(b * 16) + 2 * j + h;
                    const qv hb = qv_ld(qj + 256 + h * 64);
                    const fv sc = fv_i8((const int8_t *)sb + 32 + (2 * j + h) * 16);
                    _mm512_store_ps(g->sw + u * 16, fv_mul(d, sc));
                    _mm512_store_ps(g->mw + u * 16, z);
                    for (int cc = 0; cc < 2; cc++) {
                        const int c = 2 * h + cc;
                        const qv w = qv_ld(qj + c * 64);
                        const qv lo = qv_or(qv_lo(w), qv_b6(hb, 2 * cc));
                        const qv hi = qv_or(qv_hi(w), qv_b6(hb, 2 * cc + 1));
                        st_b(o + 2 * c * 64, _mm512_sub_epi8(lo, c32));
                        st_b(o + (2 * c + 1) * 64, _mm512_sub_epi8(hi, c32));
                    }
                }
                continue;
            }
            const int five = qt == CPUD_Q5_K, sub = q_fmt[qt].qbytes / 8;
            const uint8_t *qj = q + b * 8 * sub + j * sub;
            const qv hb = five ? qv_ld(qj + 256) : qv_ld(qj);
            const fv dmin = fv_h16((const uint16_t *)(sb + 32));
            _mm512_store_ps(g->sw + (b * 8 + j) * 16, fv_mul(d, fv_u8(sb + 64 + j * 16)));
            const fv mn = fv_mul(dmin, fv_u8(sb + 192 + j * 16));
            _mm512_store_ps(g->mw + (b * 8 + j) * 16, fv_mul(fv_set1(-1.0f), mn));
            for (int c = 0; c < 4; c++) {
                const qv w = qv_ld(qj + c * 64);
                qv lo = qv_lo(w), hi = qv_hi(w);
                if (five) {
                    lo = qv_or(lo, qv_b4(hb, 2 * c));
                    hi = qv_or(hi, qv_b4(hb, 2 * c + 1));
                }
                st_b(o + 2 * c * 64, lo);
                st_b(o + (2 * c + 1) * 64, hi);
            }
        }
    }
}

/* x's per-KT scale and scale * sum for every 16-row tile: [tiles][nsub][16] each. */
static void x_scales(const qact *a, int64_t Mpad, int kt, float *dx, float *ex) {
    const int64_t nsub = a->K / kt, nd = a->K / 32, ns = a->K / 16;
#pragma omp parallel for schedule(static) if (Mpad * nsub >= CPUD_PAR_MIN)
    for (int64_t m = 0; m < Mpad; m++)
        for (int64_t u = 0; u < nsub; u++) {
            const float d = a->d[m * nd + u * kt / 32];
            const int32_t *s = a->s + m * ns;
            const int32_t sx = kt == 32 ? s[2 * u] + s[2 * u + 1] : s[u];
            const int64_t i = ((m / 16) * nsub + u) * 16 + m % 16;
            dx[i] = d;
            ex[i] = d * (float)sx;
        }
}

/* mins: the type has w_min terms (Q4_1, K-quants). */
static ALWAYS_INLINE ATGT void epilogue(__m512 *acc, const int32_t *c, const float *sw,
                                        const float *mw, const float *dx, const float *ex,
                                        const int mins) {
    const __m512 s = _mm512_load_ps(sw), mn = _mm512_load_ps(mw);
#pragma GCC unroll 16
    for (int m = 0; m < 16; m++) {
        const __m512 f = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(c + m * 16)));
        acc[m] = _mm512_fmadd_ps(f, _mm512_mul_ps(s, _mm512_set1_ps(dx[m])), acc[m]);
        if (mins) acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(ex[m]), acc[m]);
    }
}

/* C tile ct = A (x, sub-block u) . B (weights, sub-block u), from zero. */
#define TILE_STEP(ct, at, bt, u)                                                                   \
    do {                                                                                           \
        _tile_loadd(at, xq + (u) * kt, K);                                                         \
        _tile_loadd(bt, g->b + (u) * bstep, 64);                                                   \
        _tile_zero(ct);                                                                            \
        _tile_dpbssd(ct, at, bt);                                                                  \
    } while (0)

#define EPI(i, u)                                                                                  \
    epilogue(acc, c[i], g->sw + (u) * 16, g->mw + (u) * 16, dx + (u) * 16, ex + (u) * 16, mins)

/* acc[16] += x rows . the group's 16 w rows over sub-blocks [u0, u1).  Four sub-blocks per
 * step on tiles 0-3, so the tile unit works on the next ones while the vector unit scales
 * these. */
static ALWAYS_INLINE ATGT void rows_range(const int8_t *xq, int64_t K, int kt, int64_t u0,
                                          int64_t u1, const qgroup *g, const float *dx,
                                          const float *ex, __m512 *acc, const int mins) {
    int32_t c[4][256] __attribute__((aligned(64)));
    const int64_t bstep = kt * 16;
    int64_t u = u0;
    for (; u + 3 < u1; u += 4) {
        TILE_STEP(0, 4, 6, u);
        TILE_STEP(1, 5, 7, u + 1);
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        TILE_STEP(2, 4, 6, u + 2);
        TILE_STEP(3, 5, 7, u + 3);
        _tile_stored(2, c[2], 64);
        _tile_stored(3, c[3], 64);
        EPI(0, u);
        EPI(1, u + 1);
        EPI(2, u + 2);
        EPI(3, u + 3);
    }
    for (; u < u1; u++) {
        TILE_STEP(0, 4, 6, u);
        _tile_stored(0, c[0], 64);
        EPI(0, u);
    }
}

/* res [16][16] = x rows [m0, m0 + 16) . the group's 16 w rows, summed as the vector kernels do
 * (quant_kernels.h, Q_HALF): sub-blocks [0, hu) and [hu, nsub) apart, then added. */
static ALWAYS_INLINE ATGT void tile_rows(const int8_t *xq, int64_t K, int kt, int64_t nsub,
                                         int64_t hu, const qgroup *g, const float *dx,
                                         const float *ex, float *res, const int mins) {
    __m512 acc[16];
#pragma GCC unroll 16
    for (int m = 0; m < 16; m++) acc[m] = _mm512_setzero_ps();
    rows_range(xq, K, kt, 0, hu, g, dx, ex, acc, mins);
#pragma GCC unroll 16
    for (int m = 0; m < 16; m++) {
        _mm512_store_ps(res + m * 16, acc[m]);
        acc[m] = _mm512_setzero_ps();
    }
    rows_range(xq, K, kt, hu, nsub, g, dx, ex, acc, mins);
#pragma GCC unroll 16
    for (int m = 0; m < 16; m++)
        _mm512_store_ps(res + m * 16, _mm512_add_ps(_mm512_load_ps(res + m * 16), acc[m]));
}

/* q_store with whole rows of 16 outputs in vectors (bf16: round to nearest even, as st1). */
static ATGT void store_rows(const float *res, int mr, int64_t m0, int64_t g, int64_t N,
                            const float *bias, void *out, int odt, int64_t os) {
    const int64_t n0 = g * QR;
    if (N - n0 < QR) {
        q_store(res, mr, m0, g, N, bias, out, odt, os);
        return;
    }
    const __m512 b = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
    const __m512i exp = _mm512_set1_epi32(0x7f800000), one = _mm512_set1_epi32(1);
    for (int m = 0; m < mr; m++) {
        const __m512 v = _mm512_add_ps(_mm512_load_ps(res + m * QR), b);
        const int64_t at = (m0 + m) * os + n0;
        if (odt == CPUD_F32) {
            _mm512_storeu_ps((float *)out + at, v);
            continue;
        }
        const __m512i u = _mm512_castps_si512(v);
        const __mmask16 nan =
            _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), exp);
        __m512i r = _mm512_add_epi32(u, _mm512_set1_epi32(0x7fff));
        r = _mm512_add_epi32(r, _mm512_and_si512(_mm512_srli_epi32(u, 16), one));
        r = _mm512_srli_epi32(r, 16);
        r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), _mm512_cvtepi32_epi16(r));
    }
}

static ATGT void tile_rows_sym(const int8_t *xq, int64_t K, int kt, int64_t nsub, int64_t hu,
                               const qgroup *g, const float *dx, const float *ex, float *res) {
    tile_rows(xq, K, kt, nsub, hu, g, dx, ex, res, 0);
}

static ATGT void tile_rows_min(const int8_t *xq, int64_t K, int kt, int64_t nsub, int64_t hu,
                               const qgroup *g, const float *dx, const float *ex, float *res) {
    tile_rows(xq, K, kt, nsub, hu, g, dx, ex, res, 1);
}

ATGT void cpud_qamx_unpack(int qt, const uint8_t *q, const uint8_t *s, int64_t nb, int8_t *b,
                           float *sw, float *mw) {
    const qgroup g = {b, sw, mw};
    unpack_group(qt, q, s, nb, &g);
}

ATGT void cpud_qamx_store(const float *res, int mr, int64_t m0, int64_t g, int64_t N,
                          const float *bias, void *out, int odt, int64_t os) {
    store_rows(res, mr, m0, g, N, bias, out, odt, os);
}

static _Thread_local void *t_group, *t_xs;
static _Thread_local size_t t_group_cap, t_xs_cap;

static ATGT void qgemm_amx(int qt, const qact *a, const uint8_t *qs, const uint8_t *sc,
                           const float *bias, void *out, int odt, int64_t os, int64_t M,
                           int64_t N) {
    if (M < AMX_MIN_M) {
        qgemm_k(qt, a, qs, sc, bias, out, odt, os, M, N);
        return;
    }
    const int kt = q_fmt[qt].kt, mins = q_fmt[qt].mins;
    const int64_t K = a->K, nb = K / q_fmt[qt].bs, nsub = K / kt, Mpad = (M + 15) / 16 * 16;
    const int64_t hu = Q_HALF(nb) * (q_fmt[qt].bs / kt);
    const int64_t groups = (N + QR - 1) / QR, nmc = (M + AMC - 1) / AMC, tasks = groups * nmc;
    const int64_t qstride = nb * q_fmt[qt].qbytes, sstride = nb * q_fmt[qt].sbytes;
    float *dx = q_grow(&t_xs, &t_xs_cap, (size_t)(2 * Mpad * nsub) * sizeof(float));
    if (!dx) { /* no memory for the tile path's scratch: the vector kernel needs none */
        qgemm_k(qt, a, qs, sc, bias, out, odt, os, M, N);
        return;
    }
    float *ex = dx + Mpad * nsub;
    x_scales(a, Mpad, kt, dx, ex);
    const size_t gbytes = (size_t)(nsub * kt * 16) + (size_t)(2 * nsub * 16) * sizeof(float);
#pragma omp parallel if (tasks > 1)
    {
        char *buf = q_grow(&t_group, &t_group_cap, gbytes);
        const qgroup g = {(int8_t *)buf, (float *)(buf + nsub * kt * 16),
                          (float *)(buf + nsub * kt * 16) + nsub * 16};
        float res[256] __attribute__((aligned(64)));
        int64_t have = -1;
        if (buf) amx_config(kt);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t gi = task % groups, mc = task / groups;
            const int64_t m1 = (mc + 1) * AMC < M ? (mc + 1) * AMC : M;
            if (!buf) { /* this thread could not get its scratch: the vector kernel */
                float r4[4 * QR];
                qtile t = {qs + gi * qstride, sc + gi * sstride, a, mc * AMC, nb, r4};
                for (; t.m0 < m1; t.m0++) {
                    q_tiles[qt][0](&t);
                    q_store(r4, 1, t.m0, gi, N, bias, out, odt, os);
                }
                continue;
            }
            if (have != gi) unpack_group(qt, qs + gi * qstride, sc + gi * sstride, nb, &g);
            have = gi;
            for (int64_t m0 = mc * AMC; m0 < m1; m0 += 16) {
                const int64_t t = m0 / 16;
                (mins ? tile_rows_min : tile_rows_sym)(a->q + m0 * K, K, kt, nsub, hu, &g,
                                                       dx + t * nsub * 16, ex + t * nsub * 16, res);
                store_rows(res, m1 - m0 < 16 ? (int)(m1 - m0) : 16, m0, gi, N, bias, out, odt, os);
            }
        }
        if (buf) _tile_release();
    }
}

/* 4 independent tdpbssd chains (tiles 0-3 += 4-5 . 6-7, 16 x 64 each), iters rounds. */
static ATGT double probe_amx(int64_t iters, float *sink) {
    static const int8_t zero[1024] __attribute__((aligned(64)));
    double macs = 0.0;
    float total = 0.0f;
#pragma omp parallel reduction(+ : macs, total)
    {
        qamx_cfg c;
        memset(&c, 0, sizeof c);
        c.palette = 1;
        for (int t = 0; t < 8; t++) {
            c.rows[t] = 16;
            c.colsb[t] = 64;
        }
        _tile_loadconfig(&c);
        _tile_loadd(4, zero, 64);
        _tile_loadd(5, zero, 64);
        _tile_loadd(6, zero, 64);
        _tile_loadd(7, zero, 64);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t it = 0; it < iters; it++) {
            _tile_dpbssd(0, 4, 6);
            _tile_dpbssd(1, 4, 7);
            _tile_dpbssd(2, 5, 6);
            _tile_dpbssd(3, 5, 7);
        }
        int32_t out[256] __attribute__((aligned(64)));
        _tile_stored(0, out, 64);
        _tile_release();
        total += (float)out[0];
        macs += (double)iters * 4 * 16 * 16 * 64;
    }
    *sink = total;
    return 2.0 * macs;
}

const cpud_qops cpud_qops_amx = {
    .name = "amx amx-int8",
    .quantize = quantize_k,
    .gemm = qgemm_amx,
    .gemm_parts = qgemm_parts_k,
    .gemm_parts_part = qgemm_parts_part_k,
    .probe = probe_amx,
    .rows = qrows_k,
    .mrows = 16,
};
#else
const cpud_qops cpud_qops_amx; /* never handed out: quant_api.c checks CPUD_CAN_AMX */
#endif
