/* The decode path of cpud_decoder_layers: one parallel region runs the whole layer stack.
 * Included by decoder.c after its helpers.  Every thread of the team walks the same phases;
 * in each it does its share of one op with the op's own partition (the quantized GEMM's run
 * of tasks, attention's work ranges, a run of token rows for the row-wise ops), and a barrier
 * ends a phase whose result other threads read next.  Row-wise ops on the same tokens follow
 * each other without one (norm, then quantization of the normed rows).  x is quantized once
 * per input and shared by every linear part that reads it; an expert layer runs its one
 * region's body (moe.c) in the team.  Each element is computed by the
 * same code on the same inputs as on the per-op path, so both give the same bits. */
#include <stdatomic.h>

#include "att_plan.h"
#include "moe.h"
#include "quant.h"

/* Steps of at most this many tokens (decode) run as one team; larger ones op by op. */
#define TEAM_MAX_T 32

/* x quantized for the linears: [T][K] int8 with per-32 scales and per-16 sums (qact), K up to
 * that of the widest input. */
typedef struct team_xq {
    int8_t *q;
    float *d;
    int32_t *s;
} team_xq;

#define TEAM_WINDOWS 4

typedef struct team {
    const cpud_ops *ops;
    int isa;
    const cpud_qops *qops;
    const cpud_decoder_dims *d;
    const cpud_decoder_layer *layers;
    int64_t n_layers;
    cpud_decoder_step *s;
    cpud_shm *tp;
    int64_t timeout_ns;
    int *peer;
    /* attention's work lists: [0] for no window, then one per other window the layers have
     * (up to TEAM_WINDOWS - 1; a layer of any further window takes [0], which is correct for
     * any window, only less even) */
    att_plan att[TEAM_WINDOWS];
    int64_t att_window[TEAM_WINDOWS];
    int n_att;
    team_xq xq;
    task_slot *steal; /* one per thread: the quantized linears' work stealing */
    cpud_moe_job *moe; /* the expert layer's step in flight */
    _Atomic int rc;              /* the first failure's code */
    _Atomic int64_t failed_phase; /* the phase it happened in; INT64_MAX: none */
} team;

static int team_part_ok(int qt, intptr_t qs, intptr_t sc, int64_t n, int64_t K) {
    return qt >= 0 && qt < Q_TYPES && qs && qs % 64 == 0 && sc && n >= 1 &&
           K % q_fmt[qt].bs == 0 && K % 32 == 0;
}

/* A linear of K inputs the team can run as it is: packed bf16 (layer_ok has checked it), or
 * quantized where cpud_quant_linear's checks pass and it would run gemm_parts (amx: the tiles
 * take 16 rows or more). */
static int team_linear_ok(const cpud_qops *qops, const cpud_qlinear *q, int64_t K, int64_t T) {
    if (q->parts == 0) return 1;
    if (q->parts < 1 || q->parts > CPUD_QPARTS_MAX || (qops == &cpud_qops_amx && T >= 16))
        return 0;
    for (int64_t p = 0; p < q->parts; p++)
        if (!team_part_ok(q->qtype[p], q->qs[p], q->sc[p], q->n[p], K)) return 0;
    return 1;
}

/* Whether this step runs as one team: few tokens, every layer's linears as team_linear_ok
 * says, its feed-forward those or a cpud_moe expert layer. */
static int team_fits(const cpud_qops *qops, const cpud_decoder_dims *d,
                     const cpud_decoder_layer *layers, int64_t n_layers, int64_t T) {
    if (!qops || T > TEAM_MAX_T) return 0;
    const int64_t H = d->hidden, qd = d->heads * d->head_dim, I = d->intermediate;
    for (int64_t i = 0; i < n_layers; i++) {
        const cpud_decoder_layer *l = &layers[i];
        if (!team_linear_ok(qops, &l->q_qkv, H, T) ||
            !team_linear_ok(qops, &l->q_o, qd, T))
            return 0;
        if (!l->moe && (!team_linear_ok(qops, &l->q_gate_up, H, T) ||
                        !team_linear_ok(qops, &l->q_down, I, T)))
            return 0;
    }
    return 1;
}

static void team_fail(team *tm, int rc, int64_t phase) {
    int none = CPUD_OK;
    atomic_compare_exchange_strong(&tm->rc, &none, rc);
    int64_t seen = atomic_load(&tm->failed_phase);
    while (phase < seen && !atomic_compare_exchange_weak(&tm->failed_phase, &seen, phase)) {
    }
}

/* Ends phase *phase: a barrier, then whether any thread failed in it or before (every thread
 * sees the same answer at the same barrier: a failure of the next phase is not counted). */
static int team_sync(team *tm, int64_t *phase) {
#pragma omp barrier
    return atomic_load(&tm->failed_phase) <= (*phase)++;
}

/* Rows [r0, r1) of x [T][K] (row stride xs) quantized into tm->xq as rows of K for the
 * linear q (nothing for a packed bf16 one: it reads x). */
static void team_quantize(team *tm, const cpud_qlinear *q, const char *x, int64_t xs, int64_t K,
                          int64_t r0, int64_t r1) {
    if (r1 <= r0 || q->parts == 0) return;
    const int es = dtype_size(tm->d->dtype);
    tm->qops->quantize(x + r0 * xs * es, tm->d->dtype, xs, r1 - r0, K, tm->xq.q + r0 * K,
                       tm->xq.d + r0 * (K / 32), tm->xq.s + r0 * (K / 16));
}

/* Thread tid's equal share of the T x nb blocks of 32 of a step's rows (row by row), taken as
 * runs within one row: block_run_next sets row *t, blocks [*b0, *b1) and returns 1 while the
 * share lasts. */
typedef struct block_share {
    int64_t u, u1, nb;
} block_share;

static block_share team_block_share(int64_t T, int64_t nb, int tid, int nth) {
    return (block_share){T * nb * tid / nth, T * nb * (tid + 1) / nth, nb};
}

static int block_run_next(block_share *sh, int64_t *t, int64_t *b0, int64_t *b1) {
    if (sh->u >= sh->u1) return 0;
    *t = sh->u / sh->nb;
    *b0 = sh->u % sh->nb;
    *b1 = sh->u1 - *t * sh->nb < sh->nb ? sh->u1 - *t * sh->nb : sh->nb;
    sh->u = *t * sh->nb + *b1;
    return 1;
}

/* All T rows of x quantized into tm->xq as team_quantize does, each thread taking an equal share
 * of the T K/32 blocks of 32 (a block's int8 values, scale and sums depend on it alone): for
 * an input no thread has begun to quantize as its rows were computed. */
static void team_quantize_blocks(team *tm, const cpud_qlinear *q, const char *x, int64_t xs,
                                 int64_t K, int tid, int nth) {
    if (q->parts == 0) return;
    const int dt = tm->d->dtype, es = dtype_size(dt);
    const int64_t nb = K / 32;
    block_share sh = team_block_share(tm->s->T, nb, tid, nth);
    for (int64_t t, b0, b1; block_run_next(&sh, &t, &b0, &b1);)
        tm->qops->quantize(x + (t * xs + b0 * 32) * es, dt, xs, 1, (b1 - b0) * 32,
                           tm->xq.q + t * K + b0 * 32, tm->xq.d + t * nb + b0,
                           tm->xq.s + t * (K / 16) + b0 * 2);
}

/* The gated activation act = act(gate) * up of the step's gate_up rows, with act quantized for
 * the down projection q: thread tid's run of tokens; or, where the step has fewer tokens than
 * threads and q is quantized, every token's blocks of 32 columns split evenly (each column is
 * computed alone and takes the vector path it takes in a whole row, so either split gives the
 * same bits). */
static void team_activation(team *tm, const cpud_qlinear *q, int tid, int nth) {
    const cpud_decoder_dims *d = tm->d;
    const int dt = d->dtype, es = dtype_size(dt);
    const int64_t T = tm->s->T, I = d->intermediate;
    const char *gu = (const char *)tm->s->gate_up;
    char *act = (char *)tm->s->act;
    void (*const fn)(int, const void *, int64_t, void *, int64_t, int64_t, int64_t, int64_t) =
        d->activation == 1 ? tm->ops->gelu_tanh_and_mul : tm->ops->silu_and_mul;
    if (T >= nth || q->parts == 0) {
        const int64_t r0 = T * tid / nth, r1 = T * (tid + 1) / nth;
        if (r1 > r0) fn(dt, gu + r0 * 2 * I * es, 2 * I, act + r0 * I * es, I, r1 - r0, I, I);
        team_quantize(tm, q, act, I, I, r0, r1);
        return;
    }
    block_share sh = team_block_share(T, I / 32, tid, nth);
    for (int64_t t, b0, b1; block_run_next(&sh, &t, &b0, &b1);)
        fn(dt, gu + (t * 2 * I + b0 * 32) * es, 2 * I, act + (t * I + b0 * 32) * es, I, 1,
           (b1 - b0) * 32, I);
    team_quantize_blocks(tm, q, act, I, I, tid, nth); /* the same blocks: no barrier between */
}

/* q's parts as the quantized GEMM takes them (side by side in the output's columns). */
static void team_parts(const cpud_qlinear *q, qpart *p) {
    int64_t col = 0;
    for (int i = 0; i < q->parts; i++) {
        p[i] = (qpart){q->qtype[i], (const uint8_t *)q->qs[i], (const uint8_t *)q->sc[i],
                       (const float *)q->bias[i], q->n[i], col};
        col += q->n[i];
    }
}

/* This thread's share of out [T][N] (row stride os) = x [T][K] (row stride xs) W^T (+ bias):
 * the packed bf16 GEMM, or the quantized one on xq; thread 0 adds the phase's time (through
 * the barrier that ends it) to s->linear_ns. */
static int team_linear(team *tm, const cpud_qlinear *q, intptr_t packed, intptr_t bias,
                       const char *x, int64_t xs, int64_t K, char *out, int64_t os, int64_t N,
                       int tid, int nth, int64_t *phase) {
    const int64_t t0 = tid == 0 ? cpud_now_ns() : 0;
    const int dt = tm->d->dtype;
    if (q->parts == 0) {
        const int rc = tm->ops->gemm_packed_part(x, dt, xs, (const uint16_t *)packed,
                                                 (const void *)bias, CPUD_F32, out, dt, os,
                                                 tm->s->T, N, K, tid, nth);
        if (rc) team_fail(tm, rc, *phase);
        const int failed = team_sync(tm, phase);
        if (tid == 0) tm->s->linear_ns += cpud_now_ns() - t0;
        return failed;
    }
    qpart p[CPUD_QPARTS_MAX];
    team_parts(q, p);
    const qact a = {tm->xq.q, tm->xq.d, tm->xq.s, K};
    const task_steal st = {tm->steal, (uint64_t)*phase + 1};
    tm->qops->gemm_parts_part(p, (int)q->parts, &a, out, dt, os, tm->s->T, tid, nth, &st);
    const int failed = team_sync(tm, phase);
    if (tid == 0) tm->s->linear_ns += cpud_now_ns() - t0;
    return failed;
}

/* Bytes of its share of a quantized linear's weights each thread prefetches (into L2) as soon as
 * the linear before it ends: the phases in between (norms, attention, the barriers) then hide
 * the start of the share's stream, which would otherwise ramp up from memory after them
 * (perf/ab_native_builds.py, Zen 4, 2 threads: decode 1 of qwen3-0.6b-shaped files 1.008-1.023x
 * in the host's fast memory periods, 1.006x in its slow one). */
#define TEAM_PF_BYTES 8192

/* Prefetch the first TEAM_PF_BYTES of thread tid's share of q (K inputs, T rows of x; the run
 * of tasks qgemm_parts_part_k gives it) and their scales; nothing for a packed bf16 linear. */
static void team_prefetch_share(const cpud_qlinear *q, int64_t K, int64_t T, int tid, int nth) {
    if (q->parts < 1 || q->parts > CPUD_QPARTS_MAX) return;
    qpart p[CPUD_QPARTS_MAX];
    int64_t first[CPUD_QPARTS_MAX + 1];
    team_parts(q, p);
    const int64_t tasks = q_part_tasks(p, (int)q->parts, T, first), task = tasks * tid / nth;
    if (task >= tasks) return;
    const int i = q_task_part(first, task);
    const qformat *f = &q_fmt[p[i].qt];
    const int64_t g = (task - first[i]) / q_chunks(T), nb = K / f->bs;
    const char *qs = (const char *)p[i].qs + g * nb * f->qbytes;
    const char *sc = (const char *)p[i].sc + g * nb * f->sbytes;
    for (int64_t o = 0; o < TEAM_PF_BYTES; o += 64) __builtin_prefetch(qs + o, 0, 2);
    for (int64_t o = 0; o < TEAM_PF_BYTES * f->sbytes / f->qbytes; o += 64)
        __builtin_prefetch(sc + o, 0, 2);
}

/* Prefetches for writing the cache rows of KV heads [h0, h1) that the n tokens' slots name,
 * ahead of cpud_kv_write: a new token's rows are cold, and each line of them a miss to memory,
 * which the q / k norms and the rotary embedding in between then hide. */
static void team_prefetch_kv_rows(const void *cache, int kvt, const int64_t *slots, int64_t n,
                                  int64_t nkv, int64_t h0, int64_t h1, int64_t hd, int64_t bs) {
    const int64_t rb = kv_row_bytes(kvt, hd);
    for (int64_t t = 0; t < n; t++) {
        if (slots[t] < 0) continue;
        for (int64_t h = h0; h < h1; h++) {
            const char *row =
                (const char *)cache + ((slots[t] / bs * nkv + h) * bs + slots[t] % bs) * rb;
            for (const char *c = row - (uintptr_t)row % 64; c < row + rb; c += 64)
                __builtin_prefetch(c, 1, 3);
        }
    }
}

/* Thread tid's share of the q / k norms, rotary embedding, the queries' rotation into a quantized
 * cache's basis (kv_formats.h) and the KV write of layer l: its run of
 * tokens, every head; or, where the step has fewer tokens than threads, every token and its run
 * of the query heads and of the KV heads (each with its k norm, rotation, K and V rows).  Each
 * head is computed alone, so either split gives the same bits. */
static void team_qk_heads(team *tm, const cpud_decoder_layer *l, int tid, int nth) {
    const cpud_ops *ops = tm->ops;
    const cpud_decoder_dims *d = tm->d;
    const cpud_decoder_step *s = tm->s;
    const int dt = d->dtype, es = dtype_size(dt), wdt = d->norm_wdt, kvt = cache_dtype(d);
    const int64_t T = s->T, nh = d->heads, nkv = d->kv_heads, hd = d->head_dim;
    const int64_t qn = (nh + 2 * nkv) * hd;
    int64_t t0 = 0, n = T, qa = 0, qb = nh, ka = 0, kb = nkv;
    if (T >= nth) {
        t0 = T * tid / nth;
        n = T * (tid + 1) / nth - t0;
    } else {
        qa = nh * tid / nth;
        qb = nh * (tid + 1) / nth;
        ka = nkv * tid / nth;
        kb = nkv * (tid + 1) / nth;
    }
    if (n <= 0 || (qb <= qa && kb <= ka)) return;
    const int64_t *pos = (const int64_t *)s->positions + t0;
    const int64_t *slots = (const int64_t *)s->slots + t0;
    char *q = (char *)s->qkv + t0 * qn * es, *k = q + nh * hd * es, *v = k + nkv * hd * es;
    char *qh = q + qa * hd * es, *kh = k + ka * hd * es;
    team_prefetch_kv_rows((const void *)l->key_cache, kvt, slots, n, nkv, ka, kb, hd,
                          d->block_size);
    team_prefetch_kv_rows((const void *)l->value_cache, kvt, slots, n, nkv, ka, kb, hd,
                          d->block_size);
    if (l->q_norm) {
        if (qb > qa)
            ops->rms_norm(dt, qh, qn, qh, qn, (const void *)l->q_norm, wdt, n, qb - qa, hd,
                          d->eps);
        if (kb > ka)
            ops->rms_norm(dt, kh, qn, kh, qn, (const void *)l->k_norm, wdt, n, kb - ka, hd,
                          d->eps);
    }
    if (l->cos_sin) {
        if (qb > qa)
            ops->rotary(dt, pos, qh, qn, kb > ka ? kh : NULL, qn, (const float *)l->cos_sin, n,
                        qb - qa, kb - ka, hd, d->rot_dim, d->rotary_neox);
        else
            ops->rotary(dt, pos, kh, qn, NULL, qn, (const float *)l->cos_sin, n, kb - ka, 0, hd,
                        d->rot_dim, d->rotary_neox);
    }
    const cpud_rotate_fn rot = cpud_kv_rotation(ops, kvt);
    if (rot && qb > qa) cpud_kv_rotate_queries(rot, q, qn, q, qn, dt, n, qa, qb, hd);
    if (kb <= ka) return;
    cpud_kv_write(k, dt, qn, (void *)l->key_cache, kvt, rot, slots, n, nkv, ka, kb, hd,
                  d->block_size);
    cpud_kv_write(v, dt, qn, (void *)l->value_cache, kvt, rot, slots, n, nkv, ka, kb, hd,
                  d->block_size);
}

/* The all-reduce of x on thread 0 (the others wait at the barrier); nothing without tp. */
static int team_all_reduce(team *tm, char *x, int tid, int64_t *phase) {
    if (!tm->tp) return 0;
    if (tid == 0) {
        const int rc = all_reduce(tm->tp, tm->d->dtype, x, tm->s->T * tm->d->hidden,
                                  tm->timeout_ns, tm->peer, tm->s);
        if (rc) team_fail(tm, rc, *phase);
    }
    return team_sync(tm, phase);
}

/* The expert layer l on x in place (called as the phase that completes x ends): thread 0
 * allocates the step, every thread computes its share of the router logits, then of the
 * experts, thread 0 frees; whether the team stops. */
static int team_moe(team *tm, const cpud_decoder_layer *l, int tid, int nth, int64_t *phase) {
    if (tid == 0) {
        const int rc = cpud_moe_layer_begin(tm->ops, tm->isa, tm->d->dtype,
                                            (const cpud_moe *)l->moe, (const void *)tm->s->x,
                                            (void *)tm->s->x, tm->s->T, &tm->moe);
        if (rc) team_fail(tm, rc, *phase);
    }
    if (team_sync(tm, phase)) {
        if (tid == 0 && tm->moe) cpud_moe_layer_end(tm->moe); /* begin sets NULL on failure */
        return 1;
    }
    const int rc = cpud_moe_layer_router_part(tm->moe, tid, nth);
    if (rc) team_fail(tm, rc, *phase);
    if (team_sync(tm, phase)) {
        if (tid == 0) cpud_moe_layer_end(tm->moe);
        return 1;
    }
    cpud_moe_layer_run(tm->moe);
    if (tid == 0) {
        const int rc = cpud_moe_layer_end(tm->moe);
        if (rc) team_fail(tm, rc, *phase);
    }
    return 0;
}

/* The work list of a layer of this sliding window (0: none). */
static att_plan *team_att(team *tm, int64_t window) {
    for (int k = 1; k < tm->n_att; k++)
        if (tm->att_window[k] == window) return &tm->att[k];
    return &tm->att[0];
}

/* tm->att: one work list for no window and one per other window of the layers (TEAM_WINDOWS
 * at most), for nr threads; CPUD_OK, or CPUD_ENOMEM with none left to free. */
static int team_att_plans(team *tm, int nr) {
    const cpud_decoder_step *s = tm->s;
    const cpud_decoder_dims *d = tm->d;
    tm->n_att = 0;
    for (int64_t i = -1; i < tm->n_layers && tm->n_att < TEAM_WINDOWS; i++) {
        const int64_t window = i < 0 ? 0 : tm->layers[i].window;
        int known = 0;
        for (int k = 0; k < tm->n_att; k++) known |= tm->att_window[k] == window;
        if (known) continue;
        if (att_plan_new((const int32_t *)s->query_start_loc, (const int32_t *)s->seq_lens, s->S,
                         d->heads, d->kv_heads, d->head_dim, window, nr, &tm->att[tm->n_att])) {
            for (int k = 0; k < tm->n_att; k++) att_plan_free(&tm->att[k]);
            tm->n_att = 0;
            return CPUD_ENOMEM;
        }
        tm->att_window[tm->n_att++] = window;
    }
    return CPUD_OK;
}

/* The layer stack as thread tid of nth; token rows [r0, r1) are this thread's share of the
 * row-wise ops. */
static void team_run(team *tm, int tid, int nth) {
    const cpud_ops *ops = tm->ops;
    const cpud_decoder_dims *d = tm->d;
    cpud_decoder_step *s = tm->s;
    const int dt = d->dtype, es = dtype_size(dt), wdt = d->norm_wdt, kvt = cache_dtype(d);
    const int64_t T = s->T, H = d->hidden, nh = d->heads, nkv = d->kv_heads, hd = d->head_dim;
    const int64_t I = d->intermediate, qd = nh * hd, qn = (nh + 2 * nkv) * hd;
    const int64_t r0 = T * tid / nth, r1 = T * (tid + 1) / nth, n = r1 - r0;
    const int32_t *qsl = (const int32_t *)s->query_start_loc;
    const int32_t *sl = (const int32_t *)s->seq_lens, *bt = (const int32_t *)s->block_tables;
    char *x = (char *)s->x, *qkv = (char *)s->qkv, *attn = (char *)s->attn;
    char *gu = (char *)s->gate_up, *act = (char *)s->act;
    /* this thread's rows */
    char *xr = x + r0 * H * es, *rr = (char *)s->residual + r0 * H * es;
    int64_t phase = 0;
    int64_t i = 0;
    for (; i < tm->n_layers; i++) {
        const cpud_decoder_layer *l = &tm->layers[i];
        if (n) {
            if (i > 0) block_out(ops, d, xr, tm->layers[i - 1].ffn_out_norm, n);
            ops->fused_add_rms_norm(dt, xr, H, rr, H, (const void *)l->input_norm, wdt, n, H,
                                    d->eps);
        }
        team_quantize(tm, &l->q_qkv, x, H, H, r0, r1);
        if (team_sync(tm, &phase)) break;
        if (team_linear(tm, &l->q_qkv, l->qkv, l->qkv_bias, x, H, H, qkv, qn, qn, tid, nth,
                        &phase))
            break;
        team_prefetch_share(&l->q_o, qd, T, tid, nth);
        team_qk_heads(tm, l, tid, nth);
        att_plan *att = team_att(tm, l->window);
        if (tid == 0) att_plan_rearm(att);
        if (team_sync(tm, &phase)) break;
        const int rc = ops->paged_attention_part(
            dt, kvt, kv_quantized(kvt), qkv, qn, (const void *)l->key_cache,
            (const void *)l->value_cache, qsl, sl, bt, s->max_blocks, attn, qd, nh, nkv, hd,
            d->block_size, d->scale, l->window, (const float *)l->sinks, att, tid);
        if (rc) team_fail(tm, rc, phase);
        if (team_sync(tm, &phase)) break;
        team_quantize_blocks(tm, &l->q_o, attn, qd, qd, tid, nth);
        if (l->q_o.parts && team_sync(tm, &phase)) break; /* bf16: attn is complete already */
        if (team_linear(tm, &l->q_o, l->o, 0, attn, qd, qd, x, H, H, tid, nth, &phase)) break;
        if (!l->moe) team_prefetch_share(&l->q_gate_up, H, T, tid, nth);
        if (team_all_reduce(tm, x, tid, &phase)) break;
        if (n) {
            if (l->o_bias) add_bias(dt, xr, (const void *)l->o_bias, n, H);
            block_out(ops, d, xr, l->attn_out_norm, n);
            ops->fused_add_rms_norm(dt, xr, H, rr, H, (const void *)l->post_norm, wdt, n, H,
                                    d->eps);
        }
        if (l->moe) {
            if (team_moe(tm, l, tid, nth, &phase)) break;
            if (team_all_reduce(tm, x, tid, &phase)) break;
            continue;
        }
        team_quantize(tm, &l->q_gate_up, x, H, H, r0, r1);
        if (team_sync(tm, &phase)) break;
        if (team_linear(tm, &l->q_gate_up, l->gate_up, 0, x, H, H, gu, 2 * I, 2 * I, tid, nth,
                        &phase))
            break;
        team_prefetch_share(&l->q_down, I, T, tid, nth);
        team_activation(tm, &l->q_down, tid, nth);
        if (team_sync(tm, &phase)) break;
        if (team_linear(tm, &l->q_down, l->down, 0, act, I, I, x, H, H, tid, nth, &phase)) break;
        if (i + 1 < tm->n_layers) team_prefetch_share(&tm->layers[i + 1].q_qkv, H, T, tid, nth);
        if (team_all_reduce(tm, x, tid, &phase)) break;
    }
    if (i == tm->n_layers && i > 0 && n) block_out(ops, d, xr, tm->layers[i - 1].ffn_out_norm, n);
}

/* The step as one team (team_fits holds, T > 0); CPUD_OK or a kernel's or the all-reduce's
 * code. */
static int decoder_team(const cpud_ops *ops, int isa, const cpud_qops *qops,
                        const cpud_decoder_dims *d, const cpud_decoder_layer *layers,
                        int64_t n_layers, cpud_decoder_step *s, cpud_shm *tp,
                        int64_t timeout_ns, int *peer) {
    const int64_t T = s->T, qd = d->heads * d->head_dim;
    int64_t K = d->hidden > qd ? d->hidden : qd;
    if (d->intermediate > K) K = d->intermediate;
    const size_t nq = ((size_t)(T * K) + 63) / 64 * 64, nd = (size_t)(T * K / 32) * sizeof(float);
    char *buf = aligned_alloc(64, nq + nd + (size_t)(T * K / 16) * sizeof(int32_t));
    if (!buf) return CPUD_ENOMEM;
    const int nr = omp_get_max_threads();
    task_slot *steal = aligned_alloc(64, (size_t)nr * sizeof *steal);
    if (!steal) {
        free(buf);
        return CPUD_ENOMEM;
    }
    memset(steal, 0, (size_t)nr * sizeof *steal);
    team tm = {.ops = ops, .isa = isa, .qops = qops, .d = d, .layers = layers, .n_layers = n_layers,
               .s = s, .tp = tp, .timeout_ns = timeout_ns, .peer = peer, .steal = steal};
    tm.xq = (team_xq){(int8_t *)buf, (float *)(buf + nq), (int32_t *)(buf + nq + nd)};
    atomic_init(&tm.rc, CPUD_OK);
    atomic_init(&tm.failed_phase, INT64_MAX);
    if (team_att_plans(&tm, nr)) {
        free(steal);
        free(buf);
        return CPUD_ENOMEM;
    }
#pragma omp parallel num_threads(nr)
    team_run(&tm, omp_get_thread_num(), omp_get_num_threads());
    for (int k = 0; k < tm.n_att; k++) att_plan_free(&tm.att[k]);
    free(steal);
    free(buf);
    return atomic_load(&tm.rc);
}
