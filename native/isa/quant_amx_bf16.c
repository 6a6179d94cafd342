/* Quantized GEMM for many rows of x on the amx tier: AMX-BF16 tiles on weights dequantized per
 * group of 16 rows.
 *
 * x is converted to bf16 once per call (rows padded to 32 with zeros).  A task takes a pair of
 * groups (32 w rows) and a chunk of x's rows (as many as keep it and the pair in L2).  Per 32
 * rows of x, tiles 0-3 (C, fp32) accumulate A (tiles 4-5: 2 x 16 rows of x) . B (tiles 6-7: the
 * pair) over the whole of K; no per-block rescaling, the scales are in the weights.  B holds the
 * pair dequantized (cpud_qamx_unpack's signed quants and per-sub-block scales and mins, then
 * w = sw * q + mw in fp32, rounded to nearest even bf16): per 32 k, 16 rows of k pairs x 16 w
 * rows x 2 bf16, the layout tdpbf16ps reads.  While the tiles work on one pair, the vector units
 * convert the thread's next pair into the other of two slots, a few chunks after each step of 32
 * k.  Weight bytes stream once per chunk of x at their quantized size; the dequantization is
 * shared by every row of the chunk. */
#include "quant.h"

#if CPUD_CAN_AMX
#include <immintrin.h>
#include <omp.h>

#define BTGT                                                                                       \
    __attribute__((target("avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,"      \
                          "amx-tile,amx-bf16")))
/* Bytes of bf16 x one chunk of rows may take: with its pair it stays in L2 (measured: 1 MiB
 * chunks of K = 3072 redo the dequantization 4x at M = 512, 3 MiB ones stream x from L3). */
#define XCHUNK_BYTES (3 << 19)

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} bamx_cfg;

/* Its own copy of quant_amx.c's configuration on purpose: one shared out-of-line function was
 * compiled (gcc 12, -O3) without its stores to the configuration, so ldtilecfg loaded zeros. */
static BTGT void tiles_config(void) {
    bamx_cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* Scratch of one thread: per group of a pair, its int8 quants, scales and mins; two slots of
 * bf16 pairs (the one in use, the next one being converted). */
typedef struct {
    int8_t *q[2];      /* [K/4][64]          */
    float *sw[2];      /* [K/kt][16]         */
    float *mw[2];      /* [K/kt][16]         */
    uint16_t *b[2][2]; /* [slot][group]: [K/32][16][16][2] */
} bscratch;

/* Conversion of one pair's int8 groups to bf16, a chunk (16 rows x 4 k) at a time, so that it
 * runs between the tile products of the pair before it. */
typedef struct {
    const bscratch *w;
    uint16_t *const *o; /* the slot's two groups */
    int64_t t, end, per; /* next chunk over both groups, chunks to do, chunks per group */
    int kt4;             /* chunks per scale */
    __m512 sh[4], mh[4]; /* the current scale's sw, mw; lane 4r' + i: w row 4h + r' */
} bconv;

static ALWAYS_INLINE BTGT void conv_step(bconv *c) {
    const int j = c->t >= c->per;
    const int64_t t = c->t - j * c->per;
    if (t % c->kt4 == 0) {
        const __m512i quarter = _mm512_srli_epi32(
            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 2);
        const __m512 sw = _mm512_load_ps(c->w->sw[j] + t / c->kt4 * 16);
        const __m512 mw = _mm512_load_ps(c->w->mw[j] + t / c->kt4 * 16);
        for (int h = 0; h < 4; h++) {
            const __m512i idx = _mm512_add_epi32(quarter, _mm512_set1_epi32(4 * h));
            c->sh[h] = _mm512_permutexvar_ps(idx, sw);
            c->mh[h] = _mm512_permutexvar_ps(idx, mw);
        }
    }
    const int8_t *q = c->w->q[j] + t * 64;
    __m512 f[4];
    for (int h = 0; h < 4; h++) {
        const __m512i v = _mm512_cvtepi8_epi32(_mm_load_si128((const __m128i *)(q + h * 16)));
        f[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), c->sh[h], c->mh[h]);
    }
    /* bf16 [16 rows][4 k]; dword 2r + i: row r, k pair i; tile rows: pair 0, then pair 1 */
    const __m512i even =
        _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]);
    const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]);
    uint16_t *o = c->o[j] + t * 64;
    _mm512_store_si512((void *)o, _mm512_permutex2var_epi32(lo, even, hi));
    _mm512_store_si512((void *)(o + 32), _mm512_permutex2var_epi32(lo, odd, hi));
    c->t++;
}

/* Starts converting pair p (groups 2p, 2p + 1 of qs / sc) into slot: unpacks its quants to int8
 * now (a group past the last is zero); the bf16 conversion is left to conv_step. */
static BTGT bconv conv_start(int qt, const uint8_t *qs, const uint8_t *sc, int64_t qstride,
                             int64_t sstride, int64_t p, int64_t groups, int64_t K,
                             const bscratch *w, int slot) {
    const int kt = q_fmt[qt].kt;
    int n = 0;
    for (int j = 0; j < 2; j++) {
        const int64_t g = 2 * p + j;
        if (g < groups) {
            cpud_qamx_unpack(qt, qs + g * qstride, sc + g * sstride, K / q_fmt[qt].bs, w->q[j],
                             w->sw[j], w->mw[j]);
            n++;
        } else {
            memset(w->b[slot][j], 0, (size_t)K * 16 * 2);
        }
    }
    bconv c = {.w = w, .o = w->b[slot], .t = 0, .end = n * K / 4, .per = K / 4, .kt4 = kt / 4};
    return c;
}

/* x [M][K] (row stride xs, dtype dt) -> a [Mpad][K] bf16, rows past M zero. */
static BTGT void x_to_bf16(const void *x, int dt, int64_t xs, int64_t M, int64_t Mpad, int64_t K,
                           uint16_t *a) {
#pragma omp parallel for schedule(static) if (Mpad * K >= CPUD_PAR_MIN)
    for (int64_t m = 0; m < Mpad; m++) {
        uint16_t *row = a + m * K;
        if (m >= M) {
            memset(row, 0, (size_t)K * 2);
        } else if (dt == CPUD_BF16) {
            memcpy(row, (const uint16_t *)x + m * xs, (size_t)K * 2);
        } else {
            const float *xr = (const float *)x + m * xs;
            for (int64_t k = 0; k < K; k += 32) {
                const __m512bh v =
                    _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + k + 16), _mm512_loadu_ps(xr + k));
                _mm512_store_si512((void *)(row + k), (__m512i)v);
            }
        }
    }
}

/* res[g] [32][16] = x rows [m0, m0 + 32) . group g of the pair b, over all K; between tile
 * products, up to per_step chunks of c's conversion. */
static BTGT void tile_block(const uint16_t *a, int64_t K, uint16_t *const *b, float *res,
                            bconv *c, int64_t per_step) {
    const int64_t xstride = K * 2;
    const uint16_t *a1 = a + 16 * K;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < K; k += 32) {
        _tile_loadd(6, b[0] + k * 16, 64);
        _tile_loadd(7, b[1] + k * 16, 64);
        _tile_loadd(4, a + k, xstride);
        _tile_loadd(5, a1 + k, xstride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        for (int64_t i = 0; i < per_step && c->t < c->end; i++) conv_step(c);
    }
    _tile_stored(0, res, 64);
    _tile_stored(1, res + 512, 64);
    _tile_stored(2, res + 256, 64);
    _tile_stored(3, res + 512 + 256, 64);
}

static _Thread_local void *t_x, *t_w;
static _Thread_local size_t t_x_cap, t_w_cap;

BTGT int cpud_qgemm_amx_bf16(int qt, const void *x, int dt, int64_t xs, const uint8_t *qs,
                             const uint8_t *sc, const float *bias, void *out, int odt, int64_t os,
                             int64_t M, int64_t N, int64_t K) {
    const int kt = q_fmt[qt].kt;
    const int64_t nb = K / q_fmt[qt].bs, Mpad = (M + 31) / 32 * 32, groups = (N + QR - 1) / QR;
    const int64_t qstride = nb * q_fmt[qt].qbytes, sstride = nb * q_fmt[qt].sbytes;
    const int64_t pairs = (groups + 1) / 2;
    int64_t mc = XCHUNK_BYTES / (K * 2) / 32 * 32;
    mc = mc < 32 ? 32 : mc > Mpad ? Mpad : mc;
    const int64_t nmc = (Mpad + mc - 1) / mc, tasks = nmc * pairs;
    uint16_t *a = q_grow(&t_x, &t_x_cap, (size_t)(Mpad * K) * 2);
    if (!a) return CPUD_ENOMEM;
    x_to_bf16(x, dt, xs, M, Mpad, K, a);
    const size_t qbytes = (size_t)K * 16, sbytes = (size_t)(K / kt) * 16 * sizeof(float);
    const size_t bbytes = (size_t)K * 16 * 2, gbytes = qbytes + 2 * sbytes;
    int failed = 0;
#pragma omp parallel if (tasks > 1)
    {
        char *buf = q_grow(&t_w, &t_w_cap, 2 * gbytes + 4 * bbytes);
        bscratch w;
        float res[2 * 512] __attribute__((aligned(64)));
        for (int j = 0; j < 2 && buf; j++) {
            char *g = buf + j * gbytes;
            w.q[j] = (int8_t *)g;
            w.sw[j] = (float *)(g + qbytes);
            w.mw[j] = (float *)(g + qbytes + sbytes);
            for (int sl = 0; sl < 2; sl++)
                w.b[sl][j] = (uint16_t *)(buf + 2 * gbytes + (size_t)(2 * sl + j) * bbytes);
        }
        const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t t0 = tasks * tid / nt, t1 = tasks * (tid + 1) / nt;
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        } else if (t0 < t1) {
            tiles_config();
            int slot = 0;
            bconv cv = conv_start(qt, qs, sc, qstride, sstride, t0 % pairs, groups, K, &w, slot);
            while (cv.t < cv.end) conv_step(&cv);
            for (int64_t task = t0; task < t1; task++) {
                const int64_t p = task % pairs, c = task / pairs;
                const int64_t next = task + 1 < t1 ? (task + 1) % pairs : p;
                cv.t = cv.end = 0;
                if (next != p)
                    cv = conv_start(qt, qs, sc, qstride, sstride, next, groups, K, &w, slot ^ 1);
                const int64_t m1 = (c + 1) * mc < M ? (c + 1) * mc : M;
                int64_t steps = (m1 - c * mc + 31) / 32 * (K / 32);
                for (int64_t m0 = c * mc; m0 < m1; m0 += 32, steps -= K / 32) {
                    tile_block(a + m0 * K, K, w.b[slot], res, &cv,
                               (cv.end - cv.t + steps - 1) / steps);
                    const int mr = m1 - m0 < 32 ? (int)(m1 - m0) : 32;
                    for (int j = 0; j < 2 && 2 * p + j < groups; j++)
                        cpud_qamx_store(res + j * 512, mr, m0, 2 * p + j, N, bias, out, odt, os);
                }
                while (cv.t < cv.end) conv_step(&cv);
                if (next != p) slot ^= 1;
            }
            _tile_release();
        }
    }
    return failed ? CPUD_ENOMEM : CPUD_OK;
}
#endif
