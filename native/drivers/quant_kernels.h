/* Quantized GEMM kernels, written once over the int8 primitives of quant_simd_*.h and
 * instantiated by each quant_*.c.  A tile is 16 weight rows (one packed group) times MR rows of
 * x over all of K: per block, integer dots of the unpacked quants against x's int8 blocks,
 * then one fp32 multiply-add with the block scales; type offsets (Q8_0's 128, Q4_0's 8, Q6_K's
 * 32, MXFP4's E2M1_OFF) and mins come off through x's block sums. */
#include <omp.h>

/* Software prefetch, QPFD bytes ahead of the quants being read, where a tile has more than one
 * row of x (the weights feed more arithmetic per byte, and each group is read again from cache
 * by the tiles after the first) or the format is Q5_K or Q6_K (the most arithmetic per byte).  A
 * one-row tile of the other formats issues none: the hardware prefetcher alone keeps its one
 * stream at the read probe's rate, where prefetch instructions (or two streams per thread) held
 * it at 70-77 % of the probe in the host's fast memory periods (Zen 4, 2 threads); Q6_K ran at
 * 80-82 % with them and 61-73 % without, Q5_K about even. */
#define QPFD 6144
#define QPF(MR, qt, p)                                                                             \
    do {                                                                                           \
        if ((MR) > 1 || (qt) == CPUD_Q5_K || (qt) == CPUD_Q6_K)                                    \
            __builtin_prefetch((const char *)(p) + QPFD, 0, 2);                                    \
    } while (0)

/* Below this many multiply-adds a GEMM runs on the calling thread. */
#define QPAR_MIN (1 << 16)

typedef struct qtile {
    const uint8_t *q; /* [nb][qbytes]: this group's quants   */
    const uint8_t *s; /* [nb][sbytes]: this group's scales   */
    const qact *a;
    int64_t m0, nb;   /* first row of x; blocks along K      */
    float *res;       /* [MR][16]                            */
} qtile;

/* x rows m0.. of a tile from k = 0, row m at q + m K, d + m K/32, s + m K/16: int8 quants,
 * fp32 scales per 32 and int32 sums per 16. */
typedef struct qxr {
    const int8_t *q;
    const float *d;
    const int32_t *s;
    int64_t K;
} qxr;

static ALWAYS_INLINE qxr qxr_of(const qtile *t) {
    const int64_t K = t->a->K;
    return (qxr){t->a->q + t->m0 * K, t->a->d + t->m0 * (K >> 5), t->a->s + t->m0 * (K >> 4), K};
}
/* row m: [K] i8 */
#define XQ(x, m) ((x)->q + (m) * (x)->K)
/* row m, 32-block i: scale; 16-block i: sum */
#define XD(x, m, i) ((x)->d[(m) * ((x)->K >> 5) + (i)])
#define XS(x, m, i) ((x)->s[(m) * ((x)->K >> 4) + (i)])
#define XS32(x, m, i) (XS(x, m, 2 * (i)) + XS(x, m, 2 * (i) + 1))

/* Blocks [0, h) of a group sum into one accumulator and [h, nb) into another, added at the end
 * (h = Q_HALF(nb)): every variant (and the AMX tiles) sums in this order, so a row's result does
 * not depend on the rows beside it.  The blocks are read in order, one stream per thread. */
#define Q_HALF(nb) (((nb) + 1) / 2)

/* Block b of a group: its quants and scales. */
typedef struct qblk {
    const uint8_t *q, *s;
} qblk;

/* Q8_0 / Q4_0 / Q4_1 block b: one scale (and min) per 32; wide: Q8_0's byte quants.  The first
 * dot chain starts at minus the type offset times x's block sum. */
static ALWAYS_INLINE QTGT void blk_b32(const qblk *k, const qxr *x, const int MR, const int qt,
                                       int64_t b, fv *acc) {
    const int wide = qt == CPUD_Q8_0;
    const int off = wide ? Q8_OFF : qt == CPUD_Q4_0 ? 8 : 0;
    const fv dw = fv_h16((const uint16_t *)k->s);
    iv dot[4], dot2[4]; /* two chains per row: half the dependent dots */
    int32_t sx[4];
    for (int m = 0; m < MR; m++) {
        sx[m] = XS32(x, m, b);
        dot[m] = off ? iv_subs(iv_zero(), off * sx[m]) : iv_zero();
        dot2[m] = iv_zero();
    }
    for (int c = 0; c < (wide ? 8 : 4); c++) {
        QPF(MR, qt, k->q + c * 64);
        const qv w = qv_ld(k->q + c * 64);
        if (wide) {
            for (int m = 0; m < MR; m++) {
                if (c & 1)
                    dot2[m] = iv_dot8(dot2[m], w, XQ(x, m) + b * 32 + c * 4);
                else
                    dot[m] = iv_dot8(dot[m], w, XQ(x, m) + b * 32 + c * 4);
            }
            continue;
        }
        const qv lo = qv_lo(w), hi = qv_hi16(w);
        for (int m = 0; m < MR; m++) {
            dot[m] = iv_dot(dot[m], lo, XQ(x, m) + b * 32 + c * 8);
            dot2[m] = iv_dot(dot2[m], hi, XQ(x, m) + b * 32 + c * 8 + 4);
        }
    }
    for (int m = 0; m < MR; m++) {
        const float dx = XD(x, m, b);
        const iv v = wide ? iv_add(dot[m], dot2[m]) : iv_join_hi(dot[m], dot2[m]);
        acc[m] = fv_fma(fv_cvt(v), fv_mul(dw, fv_set1(dx)), acc[m]);
        if (q_fmt[qt].mins)
            acc[m] = fv_fma(fv_h16((const uint16_t *)(k->s + 32)), fv_set1(dx * (float)sx[m]), acc[m]);
    }
}

/* Q4_K / Q5_K block b: 8 sub-blocks of 32 per 256, w = d sc q - dmin mn; five: Q5_K's high
 * bits. */
static ALWAYS_INLINE QTGT void blk_k45(const qblk *k, const qxr *x, const int MR, const int qt,
                                       int64_t b, fv *acc) {
    const int five = qt == CPUD_Q5_K, sub = q_fmt[qt].qbytes / 8;
    const uint8_t *s = k->s;
    const fv d = fv_h16((const uint16_t *)s), dmin = fv_h16((const uint16_t *)(s + 32));
    for (int j = 0; j < 8; j++) {
        const fv sc = fv_mul(d, fv_u8(s + 64 + j * 16)), mn = fv_mul(dmin, fv_u8(s + 192 + j * 16));
        const uint8_t *qj = k->q + j * sub;
        const qv hb = five ? qv_ld(qj + 256) : qv_ld(qj);
        if (five) QPF(MR, qt, qj + 256);
        iv dot[4], dot2[4];
        for (int m = 0; m < MR; m++) dot[m] = dot2[m] = iv_zero();
        for (int c = 0; c < 4; c++) {
            QPF(MR, qt, qj + c * 64);
            const qv w = qv_ld(qj + c * 64);
            qv lo = qv_lo(w), hi = five ? qv_hi(w) : qv_hi16(w);
            if (five) {
                lo = qv_or(lo, qv_b4(hb, 2 * c));
                hi = qv_or(hi, qv_b4(hb, 2 * c + 1));
            }
            for (int m = 0; m < MR; m++) {
                const int8_t *xq = XQ(x, m) + b * 256 + j * 32 + c * 8;
                dot[m] = iv_dot(dot[m], lo, xq);
                dot2[m] = iv_dot(dot2[m], hi, xq + 4);
            }
        }
        for (int m = 0; m < MR; m++) {
            const float dx = XD(x, m, b * 8 + j);
            const iv v = five ? iv_add(dot[m], dot2[m]) : iv_join_hi(dot[m], dot2[m]);
            acc[m] = fv_fma(fv_cvt(v), fv_mul(sc, fv_set1(dx)), acc[m]);
            acc[m] = fv_fnma(mn, fv_set1(dx * (float)XS32(x, m, b * 8 + j)), acc[m]);
        }
    }
}

/* Q6_K block b: 16 sub-blocks of 16 per 256 with int8 scales, w = d sc (q - 32). */
static ALWAYS_INLINE QTGT void blk_q6k(const qblk *k, const qxr *x, const int MR, const int qt,
                                       int64_t b, fv *acc) {
    (void)qt;
    const uint8_t *s = k->s;
    const fv d = fv_h16((const uint16_t *)s);
    for (int j = 0; j < 8; j++)
        for (int h = 0; h < 2; h++) {
            const uint8_t *qj = k->q + j * 384;
            const qv hb = qv_ld(qj + 256 + h * 64);
            QPF(MR, qt, qj + 256 + h * 64);
            const fv sc = fv_mul(d, fv_i8((const int8_t *)s + 32 + (2 * j + h) * 16));
            iv dot[4], dot2[4];
            for (int m = 0; m < MR; m++) {
                dot[m] = iv_subs(iv_zero(), 32 * XS(x, m, b * 16 + 2 * j + h));
                dot2[m] = iv_zero();
            }
            for (int cc = 0; cc < 2; cc++) {
                const int c = 2 * h + cc;
                QPF(MR, qt, qj + c * 64);
                const qv w = qv_ld(qj + c * 64);
                const qv lo = qv_or(qv_lo(w), qv_b6(hb, 2 * cc));
                const qv hi = qv_or(qv_hi(w), qv_b6(hb, 2 * cc + 1));
                for (int m = 0; m < MR; m++) {
                    const int8_t *xq = XQ(x, m) + b * 256 + j * 32 + c * 8;
                    dot[m] = iv_dot(dot[m], lo, xq);
                    dot2[m] = iv_dot(dot2[m], hi, xq + 4);
                }
            }
            for (int m = 0; m < MR; m++) {
                const iv v = iv_add(dot[m], dot2[m]);
                acc[m] = fv_fma(fv_cvt(v), fv_mul(sc, fv_set1(XD(x, m, b * 8 + j))), acc[m]);
            }
        }
}

/* MXFP4 block b: codes through qv_e2m1 to their doubled values + E2M1_OFF (taken off through
 * x's block sum), one E8M0 scale per 32: w = 2^(e - 128) * doubled value. */
static ALWAYS_INLINE QTGT void blk_e2m1(const qblk *k, const qxr *x, const int MR, const int qt,
                                        int64_t b, fv *acc) {
    (void)qt;
    const fv e = fv_e8m0_pre(k->s);
    iv dot[4], dot2[4];
    for (int m = 0; m < MR; m++) {
        dot[m] = iv_subs(iv_zero(), E2M1_OFF * XS32(x, m, b));
        dot2[m] = iv_zero();
    }
    for (int c = 0; c < 4; c++) {
        QPF(MR, qt, k->q + c * 64);
        const qv w = qv_ld(k->q + c * 64);
        const qv lo = qv_e2m1(qv_lo(w)), hi = qv_e2m1(qv_hi(w));
        for (int m = 0; m < MR; m++) {
            dot[m] = iv_dot(dot[m], lo, XQ(x, m) + b * 32 + c * 8);
            dot2[m] = iv_dot(dot2[m], hi, XQ(x, m) + b * 32 + c * 8 + 4);
        }
    }
    for (int m = 0; m < MR; m++) {
        const iv v = iv_add(dot[m], dot2[m]);
        acc[m] = fv_fma(fv_cvt(v), fv_e8m0_times(e, fv_set1(XD(x, m, b))), acc[m]);
    }
}

/* The tile of t: blk over the group's blocks in order, the first half into acc and the rest into
 * acc2, res = acc + acc2. */
#define TILE_IN_ORDER(t, MR, blk, qt)                                                              \
    do {                                                                                           \
        const qxr x = qxr_of(t);                                                                   \
        const int64_t qb = q_fmt[qt].qbytes, sb = q_fmt[qt].sbytes, h = Q_HALF((t)->nb);          \
        fv acc[4], acc2[4];                                                                        \
        for (int m = 0; m < MR; m++) acc[m] = acc2[m] = fv_zero();                                 \
        for (int64_t i = 0; i < h; i++) {                                                          \
            const qblk k = {(t)->q + i * qb, (t)->s + i * sb};                                     \
            blk(&k, &x, MR, qt, i, acc);                                                           \
        }                                                                                          \
        for (int64_t i = h; i < (t)->nb; i++) {                                                    \
            const qblk k = {(t)->q + i * qb, (t)->s + i * sb};                                     \
            blk(&k, &x, MR, qt, i, acc2);                                                          \
        }                                                                                          \
        for (int m = 0; m < MR; m++) fv_st((t)->res + m * QR, fv_add(acc[m], acc2[m]));           \
    } while (0)

typedef void (*tile_fn)(const qtile *t);

/* Per format of quant_formats.h: tile_<name>_<MR> for MR 1, 2, 4, on its family's blk. */
#define CPUD_KERNEL_FORMAT(name, ggml_type, block_values, block_bytes, code, qb, sb, family, ...) \
    static QTGT void tile_##name##_1(const qtile *t) {                                             \
        TILE_IN_ORDER(t, 1, blk_##family, code);                                                   \
    }                                                                                              \
    static QTGT void tile_##name##_2(const qtile *t) {                                             \
        TILE_IN_ORDER(t, 2, blk_##family, code);                                                   \
    }                                                                                              \
    static QTGT void tile_##name##_4(const qtile *t) {                                             \
        TILE_IN_ORDER(t, 4, blk_##family, code);                                                   \
    }
#include "quant_formats.h"

/* [qtype][MR 1, 2, 4] */
#define CPUD_KERNEL_FORMAT(name, ggml_type, block_values, block_bytes, code, ...)                 \
    [code] = {tile_##name##_1, tile_##name##_2, tile_##name##_4},
static const tile_fn q_tiles[][3] = {
#include "quant_formats.h"
};

/* Rows [t->m0, m1) of x against t's group, out rows g*16.. (q_store). */
static ALWAYS_INLINE QTGT void q_group_tiles(int qt, qtile *t, int64_t m1, int64_t g, int64_t N,
                                             const float *bias, void *out, int odt, int64_t os) {
    while (t->m0 < m1) {
        const int64_t left = m1 - t->m0;
        const int mr = left >= QMR ? QMR : left >= 2 ? 2 : 1;
        q_tiles[qt][mr == 1 ? 0 : mr == 2 ? 1 : 2](t);
        q_store(t->res, mr, t->m0, g, N, bias, out, odt, os);
        t->m0 += mr;
    }
}

/* One GEMM's tasks: per part, its groups of 16 w rows times chunks of QMC x rows, parts one after
 * another (q_part_tasks). */
typedef struct qtasks {
    const qpart *p;
    const qact *a;
    void *out;
    int odt;
    int64_t os, M, nmc;
    int64_t first[CPUD_QPARTS_MAX + 1];
} qtasks;

static ALWAYS_INLINE QTGT void q_task(const qtasks *w, int64_t task) {
    const int i = q_task_part(w->first, task);
    const qpart *pp = w->p + i;
    const int qt = pp->qt;
    const int64_t local = task - w->first[i], g = local / w->nmc, mc = local % w->nmc;
    const int64_t nb = w->a->K / q_fmt[qt].bs, m1 = (mc + 1) * QMC < w->M ? (mc + 1) * QMC : w->M;
    char *o = (char *)w->out + pp->col * dtype_size(w->odt);
    float res[4 * QR];
    qtile t = {pp->qs + g * nb * q_fmt[qt].qbytes, pp->sc + g * nb * q_fmt[qt].sbytes, w->a,
               mc * QMC, nb, res};
    q_group_tiles(qt, &t, m1, g, pp->N, pp->bias, o, w->odt, w->os);
}

/* Thread tid of nth runs its tasks: the run [tasks * tid / nth, tasks * (tid + 1) / nth) (one
 * stream through the weights), and with st, tasks taken from the others' runs once its own is
 * done (task_steal.h).  No parallel region: the caller's team runs it, every thread once. */
static QTGT void qgemm_parts_part_k(const qpart *p, int np, const qact *a, void *out, int odt,
                                    int64_t os, int64_t M, int tid, int nth,
                                    const task_steal *st) {
    qtasks w = {p, a, out, odt, os, M, q_chunks(M), {0}};
    const int64_t tasks = q_part_tasks(p, np, M, w.first);
    if (st && nth > 1 && tasks < STEAL_MAX_TASKS) {
        STEAL_RUN(st, tid, nth, tasks, q_task, &w);
        return;
    }
    const int64_t t1 = tasks * (tid + 1) / nth;
    for (int64_t task = tasks * tid / nth; task < t1; task++) q_task(&w, task);
}

/* qgemm_parts_part_k in its own parallel region. */
static QTGT void qgemm_parts_k(const qpart *p, int np, const qact *a, void *out, int odt,
                               int64_t os, int64_t M) {
    int64_t first[CPUD_QPARTS_MAX + 1], rows = 0;
    const int64_t tasks = q_part_tasks(p, np, M, first);
    for (int i = 0; i < np; i++) rows += p[i].N;
    const int par = tasks > 1 && M * rows * a->K >= QPAR_MIN, nth = omp_get_max_threads();
    task_slot *slots = par && nth > 1 ? aligned_alloc(64, (size_t)nth * sizeof *slots) : NULL;
    if (slots) memset(slots, 0, (size_t)nth * sizeof *slots);
    const task_steal st = {slots, 1};
#pragma omp parallel if (par)
    qgemm_parts_part_k(p, np, a, out, odt, os, M, omp_get_thread_num(), omp_get_num_threads(),
                       slots ? &st : NULL);
    free(slots);
}

static QTGT void qrows_k(int qt, const qact *a, const uint8_t *qs, const uint8_t *sc,
                         const float *bias, void *out, int odt, int64_t os, int64_t m0,
                         int64_t m1, int64_t g, int64_t N) {
    const int64_t nb = a->K / q_fmt[qt].bs;
    float res[4 * QR];
    qtile t = {qs + g * nb * q_fmt[qt].qbytes, sc + g * nb * q_fmt[qt].sbytes, a, m0, nb, res};
    q_group_tiles(qt, &t, m1, g, N, bias, out, odt, os);
}

static QTGT void qgemm_k(int qt, const qact *a, const uint8_t *qs, const uint8_t *sc,
                         const float *bias, void *out, int odt, int64_t os, int64_t M, int64_t N) {
    const qpart p = {qt, qs, sc, bias, N, 0};
    qgemm_parts_k(&p, 1, a, out, odt, os, M);
}

static QTGT void quantize_k(const void *x, int dt, int64_t xs, int64_t M, int64_t K, int8_t *q,
                            float *d, int32_t *s) {
    const int es = dtype_size(dt);
    CPUD_PAR_FOR(cpud_par_ok(M * K, M), m, M,
        q_quant_row((const char *)x + m * xs * es, dt, K, q + m * K, d + m * (K / 32), s + m * (K / 16));
    );
}

static QTGT __attribute__((unused)) double probe_k(int64_t iters, float *sink) {
    double macs = 0.0;
    float total = 0.0f;
#pragma omp parallel reduction(+ : macs, total)
    macs += q_probe(iters, &total);
    *sink = total;
    return 2.0 * macs;
}

#define QUANT_OPS(sym, label)                                                                      \
    const cpud_qops sym = {.name = label,                                                          \
                           .quantize = quantize_k,                                                 \
                           .gemm = qgemm_k,                                                        \
                           .gemm_parts = qgemm_parts_k,                                            \
                           .gemm_parts_part = qgemm_parts_part_k,                                  \
                           .probe = probe_k,                                                       \
                           .rows = qrows_k,                                                        \
                           .mrows = 1}
