/* cpud_moe_* (cpud_native.h): a step's routed experts.  The T x k (token, expert) pairs are
 * grouped by expert (ascending, tokens in order within each); every expert with tokens runs its
 * gate/up GEMM, activation and down GEMM once over its gathered rows, so only the routed
 * experts' weights are read; the combine pass then sums each token's k weighted outputs into
 * out in ascending expert order, rounding as transformers' index_add does (exact in fp32, bf16
 * steps for bf16).
 *
 * Both kinds of stacks run in one parallel region.  bf16 stacks: the rows gathered, work
 * lists of (expert, weight groups, rows) items for every routed expert's gate/up (the packed
 * GEMM on their panels over all of the expert's rows), the activation by row shares, the down
 * items, then the combine by tokens.  Quantized stacks (the int8 tiles of cpud_qops.rows): x
 * quantized to int8 once per token row (gathered in sorted order only where an expert has
 * several rows), then each thread's share of the intermediate columns (gate/up of every
 * routed expert, the activation, its int8 quantization), a barrier, then its share of the
 * output columns (down, then the combine).  No two threads write one output. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch.h"
#include "moe.h"
#include "moe_items.h"
#include "quant.h"

/* A step of one expert layer: its routing (weights, ids: T x k), grouping, work lists and
 * buffers.  job_alloc and job_group fill them (a layer job: job_run routes from the router
 * logits first), job_run computes (every thread of the enclosing parallel region calls it: the
 * worksharing loops inside bind to that region), job_free frees. */
struct cpud_moe_job {
    const cpud_ops *ops;
    const cpud_qops *q; /* NULL: bf16 stacks */
    int dt;
    const cpud_moe *m;
    const void *x;
    void *out;
    int64_t T;
    const float *weights;
    const int32_t *id;
    grouping g;
    qbuf qx, qg, qa;            /* quantized stacks */
    moe_item *gu_items, *down_items;
    int64_t n_gu, n_down;
    char *xg, *gu, *act;        /* xg: bf16 stacks' gathered rows */
    _Atomic int *ready;         /* [E]: routed expert i's gate/up done (by_experts) */
    float *y;
    char *logits;               /* a layer job's router logits, weights and ids; NULL: routed */
    float *w;
    int32_t *ids;
    _Atomic int failed;
};

/* The step's buffers, which depend on T only (job_group fills the grouping's). */
static int job_alloc(cpud_moe_job *j) {
    const cpud_moe *m = j->m;
    const int64_t k = m->k, H = m->H, I = m->I, E = m->E, pairs = j->T * k;
    const int es = dtype_size(j->dt);
    j->gu = malloc((size_t)(pairs * 2 * I * es));
    j->act = malloc((size_t)(pairs * I * es));
    j->y = malloc((size_t)(pairs * H) * sizeof *j->y);
    j->g.start = malloc((size_t)(E + 1) * sizeof *j->g.start);
    j->g.rows = malloc((size_t)pairs * sizeof *j->g.rows);
    j->g.row_of = malloc((size_t)pairs * sizeof *j->g.row_of);
    j->g.experts = malloc((size_t)E * sizeof *j->g.experts);
    j->ready = malloc((size_t)E * sizeof *j->ready);
    if (!j->gu || !j->act || !j->y || !j->g.start || !j->g.rows || !j->g.row_of ||
        !j->g.experts || !j->ready)
        return CPUD_ENOMEM;
    if (!j->q) {
        j->xg = malloc((size_t)(pairs * H * es));
        return j->xg ? CPUD_OK : CPUD_ENOMEM;
    }
    if (qbuf_alloc(&j->qx, j->T, H) || qbuf_alloc(&j->qg, pairs, H) ||
        qbuf_alloc(&j->qa, pairs, I))
        return CPUD_ENOMEM;
    return CPUD_OK;
}

/* The routing (weights, id) grouped by expert, and the work lists. */
static int job_group(cpud_moe_job *j) {
    const cpud_moe *m = j->m;
    const int64_t k = m->k, H = m->H, I = m->I, E = m->E, pairs = j->T * k;
    if (group(j->id, pairs, E, &j->g)) return CPUD_ENOMEM;
    for (int64_t i = 0; i < j->g.routed; i++) atomic_init(&j->ready[i], 0);
    if (!j->q) {
        /* every item spans all of its expert's rows: the GEMM then picks its kernel as for one
         * call per expert, so the results are those of such calls, bit for bit */
        if (item_list(j->g.start, E, 2 * I, CPUD_GEMM_NB, pairs, &j->gu_items, &j->n_gu) ||
            item_list(j->g.start, E, H, CPUD_GEMM_NB, pairs, &j->down_items, &j->n_down))
            return CPUD_ENOMEM;
        return CPUD_OK;
    }
    return CPUD_OK;
}

static void route(int dt, const void *logits, int64_t T, const cpud_moe *m, float *w,
                  int32_t *ids);

/* A layer job's routing from its router logits and grouping (one thread; others may run
 * beside it); a failure is left in j->failed. */
static void job_route(cpud_moe_job *j) {
    route(j->dt, j->logits, j->T, j->m, j->w, j->ids);
    j->weights = j->w;
    j->id = j->ids;
    if (job_group(j)) atomic_store(&j->failed, 1);
}

static void job_run_bf16(cpud_moe_job *j) {
    const cpud_moe *m = j->m;
    const int64_t k = m->k, H = m->H, I = m->I, pairs = j->T * k;
    const int dtype = j->dt, es = dtype_size(dtype);
    const grouping *g = &j->g;
    int failed = 0;
    if (j->logits) {
        if (omp_get_thread_num() == 0) job_route(j);
#pragma omp barrier
        if (atomic_load(&j->failed)) return;
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < pairs; r++) {
        memcpy(j->xg + r * H * es, (const char *)j->x + g->rows[r] / k * H * es, (size_t)(H * es));
    }
    failed |= run_bf16_items(j->ops, dtype, j->gu_items, j->n_gu, j->xg, H,
                             (const uint16_t *)m->gate_up,
                             (2 * I + CPUD_GEMM_NB - 1) / CPUD_GEMM_NB * panel_elems(H),
                             m->gate_up_bias, j->gu, dtype, 2 * I);
    int64_t r0, r1;
    share(pairs, &r0, &r1);
    activation_rows(j->ops, dtype, m, j->gu, j->act, r0, r1);
#pragma omp barrier
    failed |= run_bf16_items(j->ops, dtype, j->down_items, j->n_down, j->act, I,
                             (const uint16_t *)m->down,
                             (H + CPUD_GEMM_NB - 1) / CPUD_GEMM_NB * panel_elems(I),
                             m->down_bias, (char *)j->y, CPUD_F32, H);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < j->T; t++)
        combine_token(dtype, j->y, g->row_of, j->id, j->weights, t, k, H, 0, H, j->out);
    if (failed) atomic_store(&j->failed, 1);
}

/* Until *flag is set (release): pauses, then yields the core to the thread that sets it where
 * the team has more threads than cores. */
static void wait_ready(_Atomic int *flag) {
    for (int spins = 0; !atomic_load_explicit(flag, memory_order_acquire); spins++) {
        if (spins < 1 << 14)
            _mm_pause();
        else
            sched_yield();
    }
}

static void job_run_quant(cpud_moe_job *j) {
    const cpud_moe *m = j->m;
    const cpud_qops *q = j->q;
    const int64_t k = m->k, H = m->H, I = m->I, pairs = j->T * k;
    const int dt = j->dt, es = dtype_size(dt), gqt = m->gate_up_qtype, dqt = m->down_qtype;
    int64_t guq, gus, dq, dsb;
    q_bytes(gqt, 2 * I, H, &guq, &gus);
    q_bytes(dqt, H, I, &dq, &dsb);
    const grouping *g = &j->g;
    const qbuf *qx = &j->qx, *qg = &j->qg, *qa = &j->qa;
    const qact ax = {qx->q, qx->d, qx->s, H}, ag = {qg->q, qg->d, qg->s, H};
    const qact aa = {qa->q, qa->d, qa->s, I};
    int64_t r0, r1;
    share(j->T, &r0, &r1);
    quantize_rows(q, dt, j->x, r0, r1 - r0, H, qx);
    if (j->logits && omp_get_thread_num() == 0) job_route(j); /* beside the quantization */
#pragma omp barrier
    if (atomic_load(&j->failed)) return;
    if (g->multi) { /* experts of several rows read them gathered in sorted order */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < pairs; r++) {
            const int64_t t = g->rows[r] / k;
            memcpy(qg->q + r * H, qx->q + t * H, (size_t)H);
            memcpy(qg->d + r * (H / 32), qx->d + t * (H / 32), (size_t)(H / 32) * sizeof(float));
            memcpy(qg->s + r * (H / 16), qx->s + t * (H / 16),
                   (size_t)(H / 16) * sizeof(int32_t));
        }
    }
    const uint8_t *guw = (const uint8_t *)m->gate_up, *gus_ = (const uint8_t *)m->gate_up_sc;
    const uint8_t *dw = (const uint8_t *)m->down, *dsc = (const uint8_t *)m->down_sc;
    int64_t g0, g1;
    share((H + QR - 1) / QR, &g0, &g1);
    const int64_t h0 = g0 * QR < H ? g0 * QR : H, h1 = g1 * QR < H ? g1 * QR : H;
    if (!g->multi && g->routed >= 2 * omp_get_num_threads()) {
        /* one row per expert, two experts or more per thread: work items of whole experts,
         * their gate/up (with the activation and its quantization), then their down, handed
         * out in that order as threads come free (one stream each, no barrier between them);
         * a down item waits for its gate/up item, handed out routed items before */
        const int64_t n = g->routed;
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t i = 0; i < 2 * n; i++) {
            const int64_t e = g->experts[i % n], r = g->start[e];
            if (i < n) {
                run_columns(q, gqt, g, e, e + 1, k, &ag, &ax, guw, gus_, guq, gus,
                            m->gate_up_bias, j->gu, dt, 2 * I, 0, 2 * I / QR);
                activation_rows(j->ops, dt, m, j->gu, j->act, r, r + 1);
                quantize_rows(q, dt, j->act, r, 1, I, qa);
                atomic_store_explicit(&j->ready[i], 1, memory_order_release);
                continue;
            }
            wait_ready(&j->ready[i - n]);
            run_columns(q, dqt, g, e, e + 1, k, &aa, NULL, dw, dsc, dq, dsb, m->down_bias, j->y,
                        CPUD_F32, H, 0, (H + QR - 1) / QR);
        }
#pragma omp barrier
        for (int64_t t = 0; t < j->T; t++)
            combine_token(dt, j->y, g->row_of, j->id, j->weights, t, k, H, h0, h1, j->out);
#pragma omp barrier
        return;
    }
    /* gate/up, the activation and its int8 quantization by intermediate columns: this
     * thread's share in runs of 32, their gate and up weight groups of every routed expert,
     * so no barrier between them */
    int64_t c0, c1;
    share(I / 32, &c0, &c1);
    c0 *= 32;
    c1 *= 32;
    const qact *direct = g->multi ? NULL : &ax;
    run_columns(q, gqt, g, 0, m->E, k, &ag, direct, guw, gus_, guq, gus, m->gate_up_bias, j->gu,
                dt, 2 * I, c0 / QR, c1 / QR);
    run_columns(q, gqt, g, 0, m->E, k, &ag, direct, guw, gus_, guq, gus, m->gate_up_bias, j->gu,
                dt, 2 * I, (I + c0) / QR, (I + c1) / QR);
    activation_columns(j->ops, dt, m, j->gu, j->act, pairs, c0, c1);
    for (int64_t r = 0; r < pairs && c1 > c0; r++)
        q->quantize(j->act + (r * I + c0) * es, dt, I, 1, c1 - c0, qa->q + r * I + c0,
                    qa->d + r * (I / 32) + c0 / 32, qa->s + r * (I / 16) + c0 / 16);
#pragma omp barrier
    /* down and combine by output columns: this thread's weight groups of every routed
     * expert, then the same columns of every token, so no barrier between them */
    run_columns(q, dqt, g, 0, m->E, k, &aa, NULL, dw, dsc, dq, dsb, m->down_bias, j->y, CPUD_F32,
                H, g0, g1);
    for (int64_t t = 0; t < j->T; t++)
        combine_token(dt, j->y, g->row_of, j->id, j->weights, t, k, H, h0, h1, j->out);
#pragma omp barrier
}

/* out = the routed experts' sum: every thread of the enclosing region calls it once (a
 * prepared job); a barrier ends it. */
static void job_run(cpud_moe_job *j) {
    if (j->q)
        job_run_quant(j);
    else
        job_run_bf16(j);
}

static void job_free(cpud_moe_job *j) {
    ungroup(&j->g);
    qbuf_free(&j->qx);
    qbuf_free(&j->qg);
    qbuf_free(&j->qa);
    free(j->gu_items);
    free(j->down_items);
    free(j->xg);
    free((void *)j->ready);
    free(j->gu);
    free(j->act);
    free(j->y);
    free(j->logits);
    free(j->w);
    free(j->ids);
}

/* A job's fields before job_alloc: quant: the quantized kernels for isa, or NULL. */
static int job_init(cpud_moe_job *j, const cpud_ops *ops, int isa, int dtype, const cpud_moe *m,
                    const void *x, void *out, int64_t T) {
    memset(j, 0, sizeof *j);
    j->ops = ops;
    j->dt = dtype;
    j->m = m;
    j->x = x;
    j->out = out;
    j->T = T;
    atomic_init(&j->failed, 0);
    if (m->gate_up_qtype < 0) return CPUD_OK;
    j->q = cpud_qops_for(isa, m->quant_flags);
    return j->q ? CPUD_OK : CPUD_EISA;
}

static int moe_ok(int dtype, const cpud_moe *m) {
    if (!m || (dtype != CPUD_F32 && dtype != CPUD_BF16) || m->H < 1 || m->I < 1 || m->E < 1 ||
        m->k < 1 || m->k > CPUD_MOE_MAX_K || m->k > m->E || !m->gate_up || !m->down)
        return 0;
    if ((m->router_kind != CPUD_MOE_SOFTMAX_TOPK && m->router_kind != CPUD_MOE_TOPK_SOFTMAX) ||
        (m->activation != CPUD_MOE_SILU && m->activation != CPUD_MOE_SWIGLU_OAI) ||
        !(m->swiglu_limit > 0.0f) || !isfinite(m->swiglu_alpha))
        return 0;
    if (m->gate_up_qtype == -1 && m->down_qtype == -1) return 1;
    const int g = m->gate_up_qtype, d = m->down_qtype;
    return g >= 0 && g < Q_TYPES && d >= 0 && d < Q_TYPES && m->gate_up_sc && m->down_sc &&
           m->gate_up % 64 == 0 && m->down % 64 == 0 && m->H % q_fmt[g].bs == 0 &&
           m->I % q_fmt[d].bs == 0 && m->H % 32 == 0 && m->I % 32 == 0;
}

static int routed(const cpud_ops *ops, int isa, int dtype, const cpud_moe *m, const void *x,
                  int64_t T, const float *weights, const int32_t *id, void *out) {
    if (T == 0) return CPUD_OK;
    cpud_moe_job j;
    int rc = job_init(&j, ops, isa, dtype, m, x, out, T);
    if (rc) return rc;
    j.weights = weights;
    j.id = id;
    rc = job_alloc(&j);
    if (!rc) rc = job_group(&j);
    if (!rc) {
#pragma omp parallel
        job_run(&j);
        if (atomic_load(&j.failed)) rc = CPUD_ENOMEM;
    }
    job_free(&j);
    return rc;
}

int cpud_moe_routed(int isa, int dtype, const cpud_moe *m, intptr_t x, int64_t T,
                    intptr_t weights, intptr_t ids, intptr_t out) {
    const cpud_ops *ops = cpud_ops_for(isa);
    if (!ops) return CPUD_EISA;
    if (!moe_ok(dtype, m) || T < 0 || (T > 0 && (!x || !weights || !ids || !out)))
        return CPUD_EARG;
    const int32_t *id = (const int32_t *)ids;
    for (int64_t p = 0; p < T * m->k; p++)
        if (id[p] < 0 || id[p] >= m->E) return CPUD_EARG;
    return routed(ops, isa, dtype, m, (const void *)x, T, (const float *)weights, id, (void *)out);
}

int cpud_moe_experts(int isa, int dtype, intptr_t x, int64_t T, int64_t H, int64_t I,
                     intptr_t gate_up, intptr_t down, int64_t E, intptr_t weights, intptr_t ids,
                     int64_t k, intptr_t out) {
    const cpud_moe m = {.E = E, .k = k, .H = H, .I = I, .swiglu_limit = 1.0f,
                        .gate_up_qtype = -1, .down_qtype = -1, .gate_up = gate_up, .down = down};
    return cpud_moe_routed(isa, dtype, &m, x, T, weights, ids, out);
}

/* For each token (kind, flags of m): softmax_topk: softmax (fp32) over its E router logits,
 * the k largest (ties: the lower id first), renormalised over the k (CPUD_MOE_RENORMALIZE);
 * topk_softmax: the k largest logits, softmax (fp32) over them; rounded to dt
 * (CPUD_MOE_WEIGHTS_IN_DTYPE) - transformers' routers. */
static void route(int dt, const void *logits, int64_t T, const cpud_moe *m, float *w,
                  int32_t *ids) {
    const int64_t E = m->E, k = m->k;
    const int flags = m->flags, raw = m->router_kind == CPUD_MOE_TOPK_SOFTMAX;
    CPUD_PAR_FOR(T > 16 && !omp_in_parallel(), t, T,
        const void *row = (const char *)logits + t * E * dtype_size(dt);
        float top[CPUD_MOE_MAX_K];
        int32_t *id = ids + t * k;
        float mx = ld1(row, 0, dt), sum = 0.0f, picked = 0.0f;
        if (!raw) {
            for (int64_t e = 1; e < E; e++) mx = fmaxf(mx, ld1(row, e, dt));
            for (int64_t e = 0; e < E; e++) sum += expf(ld1(row, e, dt) - mx);
        }
        int64_t n = 0;
        for (int64_t e = 0; e < E; e++) {
            const float p = raw ? ld1(row, e, dt) : expf(ld1(row, e, dt) - mx) / sum;
            if (n == k && p <= top[k - 1]) continue;
            int64_t i = n < k ? n++ : k - 1;
            while (i > 0 && top[i - 1] < p) {
                top[i] = top[i - 1];
                id[i] = id[i - 1];
                i--;
            }
            top[i] = p;
            id[i] = (int32_t)e;
        }
        if (raw) { /* softmax over the k picked logits; top[0] is their largest */
            mx = top[0];
            for (int64_t j = 0; j < k; j++) {
                top[j] = expf(top[j] - mx);
                picked += top[j];
            }
        } else {
            for (int64_t j = 0; j < k; j++) picked += top[j];
        }
        for (int64_t j = 0; j < k; j++) {
            const float v = raw || flags & CPUD_MOE_RENORMALIZE ? top[j] / picked : top[j];
            w[t * k + j] = flags & CPUD_MOE_WEIGHTS_IN_DTYPE ? rnd1(v, dt) : v;
        }
        );
}

int cpud_moe_layer_begin(const cpud_ops *ops, int isa, int dtype, const cpud_moe *m,
                         const void *x, void *out, int64_t T, cpud_moe_job **job) {
    *job = NULL;
    if (!moe_ok(dtype, m) || !m->router || T < 1) return CPUD_EARG;
    cpud_moe_job *j = malloc(sizeof *j);
    if (!j) return CPUD_ENOMEM;
    int rc = job_init(j, ops, isa, dtype, m, x, out, T);
    if (rc) {
        free(j);
        return rc;
    }
    const int64_t E = m->E, k = m->k;
    j->logits = malloc((size_t)(T * E * dtype_size(dtype)));
    j->w = malloc((size_t)(T * k) * sizeof *j->w);
    j->ids = malloc((size_t)(T * k) * sizeof *j->ids);
    rc = j->logits && j->w && j->ids ? job_alloc(j) : CPUD_ENOMEM;
    if (rc) {
        cpud_moe_layer_end(j);
        return rc;
    }
    *job = j;
    return CPUD_OK;
}

int cpud_moe_layer_router_part(cpud_moe_job *job, int tid, int nth) {
    const cpud_moe *m = job->m;
    return job->ops->gemm_packed_part(job->x, job->dt, m->H, (const uint16_t *)m->router,
                                      (const void *)m->router_bias, CPUD_F32, job->logits,
                                      job->dt, m->E, job->T, m->E, m->H, tid, nth);
}

void cpud_moe_layer_run(cpud_moe_job *job) { job_run(job); }

int cpud_moe_layer_end(cpud_moe_job *job) {
    const int rc = atomic_load(&job->failed) ? CPUD_ENOMEM : CPUD_OK;
    job_free(job);
    free(job);
    return rc;
}

int cpud_moe_layer_ops(const cpud_ops *ops, int isa, int dtype, const cpud_moe *m,
                       const void *x, void *out, int64_t T) {
    if (!moe_ok(dtype, m) || !m->router || T < 0) return CPUD_EARG;
    if (T == 0) return CPUD_OK;
    cpud_moe_job *j;
    int rc = cpud_moe_layer_begin(ops, isa, dtype, m, x, out, T, &j);
    if (rc) return rc;
    rc = ops->gemm_packed(x, dtype, m->H, (const uint16_t *)m->router,
                          (const void *)m->router_bias, CPUD_F32, j->logits, dtype, m->E, T,
                          m->E, m->H);
    if (!rc) {
#pragma omp parallel
        cpud_moe_layer_run(j);
    }
    const int end = cpud_moe_layer_end(j);
    return rc ? rc : end;
}

int cpud_moe_layer(int isa, int dtype, const cpud_moe *m, intptr_t x, int64_t T, intptr_t out) {
    const cpud_ops *ops = cpud_ops_for(isa);
    if (!ops) return CPUD_EISA;
    if (T > 0 && (!x || !out)) return CPUD_EARG;
    return cpud_moe_layer_ops(ops, isa, dtype, m, (const void *)x, (void *)out, T);
}

int cpud_moe_ffn_ops(const cpud_ops *ops, int dtype, const void *x, void *out, int64_t T,
                     int64_t H, int64_t I, int64_t E, int64_t k, int flags,
                     const uint16_t *router, const uint16_t *gate_up, const uint16_t *down) {
    const cpud_moe m = {.E = E, .k = k, .H = H, .I = I, .flags = flags, .swiglu_limit = 1.0f,
                        .router = (intptr_t)router, .gate_up_qtype = -1, .down_qtype = -1,
                        .gate_up = (intptr_t)gate_up, .down = (intptr_t)down};
    return cpud_moe_layer_ops(ops, CPUD_ISA_SCALAR, dtype, &m, x, out, T);
}

int cpud_moe_ffn(int isa, int dtype, intptr_t x, int64_t T, int64_t H, int64_t I, int64_t E,
                 int64_t k, int flags, intptr_t router, intptr_t gate_up, intptr_t down,
                 intptr_t out) {
    const cpud_ops *ops = cpud_ops_for(isa);
    if (!ops) return CPUD_EISA;
    if (T > 0 && (!x || !out)) return CPUD_EARG;
    return cpud_moe_ffn_ops(ops, dtype, (const void *)x, (void *)out, T, H, I, E, k, flags,
                            (const uint16_t *)router, (const uint16_t *)gate_up,
                            (const uint16_t *)down);
}
