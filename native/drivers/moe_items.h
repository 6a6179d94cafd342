/* The building blocks of the expert kernel (moe.c, its only includer): the (token, expert)
 * pairs grouped by expert, int8 row buffers, work items of (expert, weight groups, rows), a
 * thread's row share, the activations and the combine pass.  Worksharing loops here bind to
 * the caller's parallel region. */
#ifndef CPUD_MOE_ITEMS_H
#define CPUD_MOE_ITEMS_H

#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch.h"
#include "quant.h"

/* Bytes of one expert's quantized [n][k]: its packed quants and scales. */
static void q_bytes(int qt, int64_t n, int64_t k, int64_t *qb, int64_t *sb) {
    const int64_t groups = (n + QR - 1) / QR, nb = k / q_fmt[qt].bs;
    *qb = groups * nb * q_fmt[qt].qbytes;
    *sb = groups * nb * q_fmt[qt].sbytes;
}

static void *amalloc(size_t n) { return aligned_alloc(64, (n + 63) / 64 * 64 + 64); }

/* rows[r] = pair index (t * k + j) of sorted row r; start[e] .. start[e + 1]: expert e. */
static void group_by_expert(const int32_t *ids, int64_t pairs, int64_t E, int64_t *start,
                            int64_t *rows) {
    memset(start, 0, (size_t)(E + 1) * sizeof *start);
    for (int64_t p = 0; p < pairs; p++) start[ids[p] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    int64_t *fill = malloc((size_t)E * sizeof *fill);
    if (!fill) return;
    memcpy(fill, start, (size_t)E * sizeof *fill);
    for (int64_t p = 0; p < pairs; p++) rows[fill[ids[p]]++] = p;
    free(fill);
}

/* v rounded to bf16 and back (rnd1's rule, NaN to the canonical quiet NaN) without a branch,
 * so that loops over columns vectorize. */
static inline float rnd_bf16(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    u = (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc00000u : r;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* Columns combined per pass: combine_token's fp32 accumulators. */
#define COMBINE_RUN 256

/* out[t] columns [h0, h1) = sum over t's slots, ascending expert, of weight * y[row of the
 * slot], each product and sum rounded to dt as transformers' index_add does; the slots' loop
 * outside the columns' (each column's order of sums is the same). */
static void combine_token(int dt, const float *y, const int64_t *row_of, const int32_t *ids,
                          const float *w, int64_t t, int64_t k, int64_t H, int64_t h0,
                          int64_t h1, void *out) {
    int64_t order[CPUD_MOE_MAX_K];
    for (int64_t j = 0; j < k; j++) {
        int64_t i = j;
        while (i > 0 && ids[t * k + order[i - 1]] > ids[t * k + j]) {
            order[i] = order[i - 1];
            i--;
        }
        order[i] = j;
    }
    float acc[COMBINE_RUN];
    for (int64_t c0 = h0; c0 < h1; c0 += COMBINE_RUN) {
        const int64_t n = h1 - c0 < COMBINE_RUN ? h1 - c0 : COMBINE_RUN;
        for (int64_t i = 0; i < n; i++) acc[i] = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            const int64_t slot = t * k + order[j];
            const float *yr = y + row_of[slot] * H + c0, ws = w[slot];
            if (dt == CPUD_BF16)
                for (int64_t i = 0; i < n; i++)
                    acc[i] = rnd_bf16(acc[i] + rnd_bf16(rnd_bf16(yr[i]) * ws));
            else
                for (int64_t i = 0; i < n; i++) acc[i] = acc[i] + yr[i] * ws;
        }
        for (int64_t i = 0; i < n; i++) st1(out, t * H + c0 + i, acc[i], dt);
    }
}

/* act rows [r0, r1), columns [c0, c1) = the clamped SwiGLU of gpt-oss on gu's gate | up
 * halves. */
static void swiglu_oai_rows(int dt, const void *gu, void *act, int64_t r0, int64_t r1,
                            int64_t c0, int64_t c1, int64_t I, float alpha, float limit) {
    for (int64_t r = r0; r < r1; r++)
        for (int64_t i = c0; i < c1; i++) {
            const float g = fminf(ld1(gu, r * 2 * I + i, dt), limit);
            const float u = fmaxf(fminf(ld1(gu, r * 2 * I + I + i, dt), limit), -limit);
            st1(act, r * I + i, (u + 1.0f) * (g / (1.0f + expf(-alpha * g))), dt);
        }
}

static void activation_rows(const cpud_ops *ops, int dt, const cpud_moe *m, const char *gu,
                            char *act, int64_t r0, int64_t r1) {
    const int es = dtype_size(dt);
    if (r1 <= r0) return;
    if (m->activation == CPUD_MOE_SWIGLU_OAI)
        swiglu_oai_rows(dt, gu, act, r0, r1, 0, m->I, m->I, m->swiglu_alpha, m->swiglu_limit);
    else
        ops->silu_and_mul(dt, gu + r0 * 2 * m->I * es, 2 * m->I, act + r0 * m->I * es, m->I,
                          r1 - r0, m->I, m->I);
}

/* act columns [c0, c1) (c0 a multiple of 32) of rows [0, rows); silu on those gate and up
 * columns in place (their up values I elements after the gate's), so that each element takes
 * the path (vector or tail) it takes in a whole row. */
static void activation_columns(const cpud_ops *ops, int dt, const cpud_moe *m, const char *gu,
                               char *act, int64_t rows, int64_t c0, int64_t c1) {
    const int es = dtype_size(dt);
    const int64_t I = m->I, w = c1 - c0;
    if (rows <= 0 || w <= 0) return;
    if (m->activation == CPUD_MOE_SWIGLU_OAI) {
        swiglu_oai_rows(dt, gu, act, 0, rows, c0, c1, I, m->swiglu_alpha, m->swiglu_limit);
        return;
    }
    ops->silu_and_mul(dt, gu + c0 * es, 2 * I, act + c0 * es, I, rows, w, I);
}

static const float *bias_of(intptr_t bias, int64_t e, int64_t n) {
    return bias ? (const float *)bias + e * n : NULL;
}

/* The routing, grouped: start [E + 1], rows, row_of [pairs] (sorted row of each pair);
 * routed: the experts with rows; multi: some expert has two rows or more. */
typedef struct grouping {
    int64_t *start, *rows, *row_of;
    int64_t *experts; /* [E]: the routed experts, ascending; routed of them */
    int64_t routed;
    int multi;
} grouping;

/* g's arrays allocated: fills them. */
static int group(const int32_t *id, int64_t pairs, int64_t E, grouping *g) {
    group_by_expert(id, pairs, E, g->start, g->rows);
    /* short of pairs: the grouping's scratch could not be allocated */
    if (g->start[E] != pairs) return CPUD_ENOMEM;
    for (int64_t r = 0; r < pairs; r++) g->row_of[g->rows[r]] = r;
    g->multi = 0;
    g->routed = 0;
    for (int64_t e = 0; e < E; e++) {
        g->multi |= g->start[e + 1] - g->start[e] > 1;
        if (g->start[e + 1] > g->start[e]) g->experts[g->routed++] = e;
    }
    return CPUD_OK;
}

static void ungroup(grouping *g) {
    free(g->experts);
    free(g->start);
    free(g->rows);
    free(g->row_of);
}

/* int8 rows as cpud_qops reads them: q [rows][K], d [rows][K/32], s [rows][K/16]. */
typedef struct qbuf {
    int8_t *q;
    float *d;
    int32_t *s;
} qbuf;

static int qbuf_alloc(qbuf *b, int64_t rows, int64_t K) {
    b->q = amalloc((size_t)(rows * K));
    b->d = amalloc((size_t)(rows * (K / 32)) * sizeof(float));
    b->s = amalloc((size_t)(rows * (K / 16)) * sizeof(int32_t));
    return b->q && b->d && b->s ? CPUD_OK : CPUD_ENOMEM;
}

static void qbuf_free(qbuf *b) {
    free(b->q);
    free(b->d);
    free(b->s);
}

/* The thread's share [*r0, *r1) of n rows. */
static void share(int64_t n, int64_t *r0, int64_t *r1) {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    *r0 = n * t / nt;
    *r1 = n * (t + 1) / nt;
}

/* Quantizes rows of x [n][K] (dtype dt, contiguous) into b's rows from `row`. */
static void quantize_rows(const cpud_qops *q, int dt, const char *x, int64_t row, int64_t n,
                          int64_t K, const qbuf *b) {
    if (n > 0)
        q->quantize(x + row * K * dtype_size(dt), dt, K, n, K, b->q + row * K,
                    b->d + row * (K / 32), b->s + row * (K / 16));
}

/* A work item: weight groups [g0, g1) of expert e over sorted rows [m0, m1). */
typedef struct moe_item {
    int64_t e, g0, g1, m0, m1;
} moe_item;

/* The items of a projection with n output rows in groups of `unit` (items NULL: only
 * counted): each routed expert's rows in runs of mc, its groups in runs of cg. */
static int64_t make_items(const int64_t *start, int64_t E, int64_t n, int64_t unit, int64_t cg,
                          int64_t mc, moe_item *items) {
    const int64_t groups = (n + unit - 1) / unit;
    int64_t c = 0;
    for (int64_t e = 0; e < E; e++)
        for (int64_t m0 = start[e]; m0 < start[e + 1]; m0 += mc) {
            const int64_t m1 = m0 + mc < start[e + 1] ? m0 + mc : start[e + 1];
            for (int64_t g0 = 0; g0 < groups; g0 += cg, c++)
                if (items) items[c] = (moe_item){e, g0, g0 + cg < groups ? g0 + cg : groups, m0, m1};
        }
    return c;
}

/* Groups of `unit` rows per item: about 4 items per thread over the routed experts' groups. */
static int64_t groups_per_item(const int64_t *start, int64_t E, int64_t n, int64_t unit) {
    int64_t routed = 0;
    for (int64_t e = 0; e < E; e++) routed += start[e + 1] > start[e];
    const int64_t total = routed * ((n + unit - 1) / unit), want = 4 * (int64_t)omp_get_max_threads();
    return total / want > 1 ? total / want : 1;
}

/* A projection's work list (*items, *count; CPUD_ENOMEM when it cannot be allocated). */
static int item_list(const int64_t *start, int64_t E, int64_t n, int64_t unit, int64_t mc,
                     moe_item **items, int64_t *count) {
    const int64_t cg = groups_per_item(start, E, n, unit);
    *count = make_items(start, E, n, unit, cg, mc, NULL);
    *items = malloc((size_t)(*count > 0 ? *count : 1) * sizeof **items);
    if (!*items) return CPUD_ENOMEM;
    make_items(start, E, n, unit, cg, mc, *items);
    return CPUD_OK;
}

/* One projection by output columns: weight groups [g0, g1) of every routed expert of [e0, e1)
 * over all of its rows (a: in sorted order), in runs of QMC rows, on the calling thread (a
 * share of the caller's team).  With ax (x's rows by token), an expert of one row reads its
 * token's row there: the same int8 row as the sorted copy. */
static void run_columns(const cpud_qops *q, int qt, const grouping *gr, int64_t e0, int64_t e1,
                        int64_t k, const qact *a, const qact *ax, const uint8_t *qs,
                        const uint8_t *sc, int64_t qb, int64_t sb, intptr_t bias, void *out,
                        int odt, int64_t n, int64_t g0, int64_t g1) {
    const int64_t *start = gr->start;
    const int os = dtype_size(odt);
    for (int64_t e = e0; e < e1; e++) {
        const float *b = bias_of(bias, e, n);
        if (ax && start[e + 1] - start[e] == 1) {
            const int64_t r = start[e], t = gr->rows[r] / k, K = ax->K;
            const qact one = {ax->q + t * K, ax->d + t * (K / 32), ax->s + t * (K / 16), K};
            for (int64_t g = g0; g < g1; g++)
                q->rows(qt, &one, qs + e * qb, sc + e * sb, b, (char *)out + r * n * os, odt, n,
                        0, 1, g, n);
            continue;
        }
        for (int64_t m0 = start[e]; m0 < start[e + 1]; m0 += QMC) {
            const int64_t m1 = m0 + QMC < start[e + 1] ? m0 + QMC : start[e + 1];
            for (int64_t g = g0; g < g1; g++)
                q->rows(qt, a, qs + e * qb, sc + e * sb, b, out, odt, n, m0, m1, g, n);
        }
    }
}

/* Packed bf16 [n][K] stacks: elements of one expert, and of one panel of GEMM_NB rows. */
static int64_t panel_elems(int64_t k) { return (k + 1) / 2 * 2 * CPUD_GEMM_NB; }

/* One projection's items on bf16 stacks: each item's panels through the packed GEMM over all
 * of its expert's rows (the GEMM's own region runs on this thread alone), as one call per
 * expert computes them. */
static int run_bf16_items(const cpud_ops *ops, int dt, const moe_item *items, int64_t count,
                          const char *x, int64_t K, const uint16_t *w, int64_t estride,
                          intptr_t bias, char *out, int odt, int64_t n) {
    const int xs = dtype_size(dt), os = dtype_size(odt);
    int failed = 0;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < count; i++) {
        const moe_item *it = &items[i];
        const int64_t c0 = it->g0 * CPUD_GEMM_NB, c1 = it->g1 * CPUD_GEMM_NB < n ? it->g1 * CPUD_GEMM_NB : n;
        const float *b = bias_of(bias, it->e, n);
        failed |= ops->gemm_packed(x + it->m0 * K * xs, dt, K,
                                   w + it->e * estride + it->g0 * panel_elems(K),
                                   b ? b + c0 : NULL, CPUD_F32, out + (it->m0 * n + c0) * os, odt,
                                   n, it->m1 - it->m0, c1 - c0, K) != 0;
    }
    return failed;
}

#endif
