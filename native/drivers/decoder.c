/* cpud_decoder_layers (cpud_native.h): a stack of decoder layers (a dense or a
 * mixture-of-experts feed-forward, moe.c) as one call into the kernel table, so a step costs
 * one crossing from Python instead of a dozen per layer.  The recipe in cpud_decoder_dims and
 * the layer table (norm rounding, activation, rotary per layer, output norms, residual scale,
 * window per layer) picks the kernels; they and their order are those of the per-op path
 * (ranks/models/decoder.py, moe.py), so both give the same bits.  Decode steps run as one
 * thread team (decoder_team.h); other steps op by op, each kernel in its own parallel
 * region. */
#include "dispatch.h"
#include "kv_formats.h"
#include "moe.h"
#include "step_checks.h"

/* The KV cache's row type: kv_dtype, where 0 (CPUD_F32) means the activations' dtype. */
static int cache_dtype(const cpud_decoder_dims *d) {
    return d->kv_dtype == CPUD_F32 ? d->dtype : d->kv_dtype;
}

static int recipe_ok(const cpud_decoder_dims *d) {
    return (d->norm_wdt == d->dtype || d->norm_wdt == CPUD_F32) &&
           (d->activation == 0 || d->activation == 1) &&
           (d->rotary_neox == 0 || d->rotary_neox == 1) && isfinite(d->residual_scale) &&
           kv_pair_ok(d->dtype, cache_dtype(d)) &&
           d->residual_scale > 0.0f;
}

static int dims_ok(const cpud_decoder_dims *d) {
    return (d->dtype == CPUD_F32 || d->dtype == CPUD_BF16) && d->hidden > 0 && d->heads > 0 &&
           d->kv_heads > 0 && d->heads % d->kv_heads == 0 && d->head_dim > 0 &&
           d->rot_dim >= 2 && d->rot_dim % 2 == 0 && d->rot_dim <= d->head_dim &&
           d->rot_dim <= CPUD_ROT_MAX && d->intermediate > 0 && d->max_pos > 0 &&
           d->num_blocks >= 0 && d->block_size > 0 && recipe_ok(d);
}

static int qlinear_ok(const cpud_qlinear *q, intptr_t packed, int64_t N) {
    if (q->parts == 0) return packed != 0;
    if (q->parts < 0 || q->parts > 3) return 0;
    int64_t n = 0;
    for (int64_t p = 0; p < q->parts; p++) {
        if (q->n[p] < 1 || !q->qs[p] || !q->sc[p]) return 0;
        n += q->n[p];
    }
    return n == N;
}

static int layer_ok(const cpud_decoder_dims *d, const cpud_decoder_layer *l) {
    const int64_t qn = (d->heads + 2 * d->kv_heads) * d->head_dim;
    int ffn_ok;
    if (l->moe)
        ffn_ok = 1; /* cpud_moe_layer checks its own struct */
    else
        ffn_ok = qlinear_ok(&l->q_gate_up, l->gate_up, 2 * d->intermediate) &&
                 qlinear_ok(&l->q_down, l->down, d->hidden);
    return l->input_norm && l->post_norm && !l->q_norm == !l->k_norm &&
           qlinear_ok(&l->q_qkv, l->qkv, qn) && qlinear_ok(&l->q_o, l->o, d->hidden) && ffn_ok &&
           l->key_cache && l->value_cache && l->window >= 0;
}

/* The window whose attention reads the most blocks: 0 (global) if any layer has it, else the
 * widest; every layer's block reads lie within those of this window. */
static int64_t widest_window(const cpud_decoder_layer *layers, int64_t n_layers) {
    int64_t widest = 0;
    for (int64_t i = 0; i < n_layers; i++) {
        if (layers[i].window == 0) return 0;
        if (layers[i].window > widest) widest = layers[i].window;
    }
    return widest;
}

/* out [T][N] (row stride os) = x [T][K] (row stride xs) W^T (+ bias): the packed bf16 GEMM,
 * or the quantized one (every part in one call); its time is added to s->linear_ns. */
static int linear(int isa, const cpud_ops *ops, const cpud_decoder_dims *d, const cpud_qlinear *q,
                  intptr_t packed, intptr_t bias, const char *x, int64_t xs, char *out,
                  int64_t os, int64_t T, int64_t N, int64_t K, cpud_decoder_step *s) {
    const int dt = d->dtype;
    const int64_t t0 = cpud_now_ns();
    const int rc = q->parts == 0
                       ? ops->gemm_packed(x, dt, xs, (const uint16_t *)packed, (const void *)bias,
                                          CPUD_F32, out, dt, os, T, N, K)
                       : cpud_quant_linear(isa, d->quant_flags, q, (intptr_t)x, dt, xs,
                                           (intptr_t)out, dt, os, T, K);
    s->linear_ns += cpud_now_ns() - t0;
    return rc;
}

/* window: the widest of the layers' (widest_window) */
static int step_ok(const cpud_decoder_dims *d, const cpud_decoder_step *s, int64_t window) {
    if (s->T < 0 || s->S < 0 || s->max_blocks < 0 || !s->positions || !s->slots ||
        !s->query_start_loc || !s->seq_lens || (s->S > 0 && !s->block_tables) || !s->x ||
        !s->residual || !s->qkv || !s->attn || !s->gate_up || !s->act)
        return 0;
    return cpud_positions_ok((const int64_t *)s->positions, s->T, d->max_pos) &&
           cpud_slots_ok((const int64_t *)s->slots, s->T, d->num_blocks * d->block_size) &&
           cpud_attention_plan_ok((const int32_t *)s->query_start_loc,
                                  (const int32_t *)s->seq_lens, (const int32_t *)s->block_tables,
                                  s->max_blocks, s->T, s->S, d->num_blocks, d->block_size,
                                  window);
}

/* x [T][H] summed over the group in place; time and count go to s. */
static int all_reduce(cpud_shm *tp, int dt, char *x, int64_t n, int64_t timeout_ns, int *peer,
                      cpud_decoder_step *s) {
    if (!tp) return CPUD_OK;
    const int64_t t0 = cpud_now_ns();
    const int rc = cpud_shm_all_reduce(tp, dt, (intptr_t)x, n, timeout_ns, peer);
    s->allreduce_ns += cpud_now_ns() - t0;
    s->allreduce_calls++;
    if (rc) s->failed_collective = 1;
    return rc;
}

/* x [T][H] += bias [H], rounded to dt as torch's out + bias is. */
static void add_bias(int dt, char *x, const void *bias, int64_t T, int64_t H) {
    for (int64_t t = 0; t < T; t++) {
        void *row = x + t * H * dtype_size(dt);
        for (int64_t i = 0; i < H; i++) st1(row, i, ld1(row, i, dt) + ld1(bias, i, dt), dt);
    }
}

/* A block's output x [T][H] before its residual add: x = norm(x) with w (if any), then
 * x = dt(x * scale) unless scale is 1, as torch's x * scale rounds it. */
static void block_out(const cpud_ops *ops, const cpud_decoder_dims *d, char *x, intptr_t w,
                      int64_t T) {
    const int dt = d->dtype;
    const int64_t H = d->hidden;
    if (w) ops->rms_norm(dt, x, H, x, H, (const void *)w, d->norm_wdt, T, 1, H, d->eps);
    if (d->residual_scale == 1.0f) return;
    const float scale = d->residual_scale;
    CPUD_PAR_FOR(cpud_par_ok(T * H, T), t, T,
        void *row = x + t * H * dtype_size(dt);
        for (int64_t i = 0; i < H; i++) st1(row, i, ld1(row, i, dt) * scale, dt);
        );
}

#include "decoder_team.h"

int cpud_decoder_layers(int isa, const cpud_decoder_dims *d, const cpud_decoder_layer *layers,
                        int64_t n_layers, cpud_decoder_step *s, cpud_shm *tp,
                        int64_t timeout_ns, int *peer) {
    const cpud_ops *ops = cpud_ops_for(isa);
    if (!ops) return CPUD_EISA;
    if (!d || !layers || !s || n_layers < 0 || !dims_ok(d)) return CPUD_EARG;
    s->allreduce_ns = 0;
    s->allreduce_calls = 0;
    s->failed_collective = 0;
    s->linear_ns = 0;
    s->team = 0;
    for (int64_t i = 0; i < n_layers; i++)
        if (!layer_ok(d, &layers[i])) return CPUD_EARG;
    if (!step_ok(d, s, widest_window(layers, n_layers))) return CPUD_EARG;
    if (s->T == 0) return CPUD_OK;
    const cpud_qops *qops = cpud_qops_for(isa, d->quant_flags);
    if (team_fits(qops, d, layers, n_layers, s->T)) {
        s->team = 1;
        return decoder_team(ops, isa, qops, d, layers, n_layers, s, tp, timeout_ns, peer);
    }

    const int dt = d->dtype, es = dtype_size(dt), wdt = d->norm_wdt, kvt = cache_dtype(d);
    const cpud_rotate_fn rot = cpud_kv_rotation(ops, kvt);
    const int64_t T = s->T, H = d->hidden, nh = d->heads, nkv = d->kv_heads, hd = d->head_dim;
    const int64_t I = d->intermediate, qd = nh * hd, qn = (nh + 2 * nkv) * hd;
    const int64_t *pos = (const int64_t *)s->positions, *slots = (const int64_t *)s->slots;
    const int32_t *qsl = (const int32_t *)s->query_start_loc;
    const int32_t *sl = (const int32_t *)s->seq_lens, *bt = (const int32_t *)s->block_tables;
    char *x = (char *)s->x, *res = (char *)s->residual, *qkv = (char *)s->qkv;
    char *attn = (char *)s->attn, *gu = (char *)s->gate_up, *act = (char *)s->act;
    char *q = qkv, *k = qkv + qd * es, *v = k + nkv * hd * es;

    for (int64_t i = 0; i < n_layers; i++) {
        const cpud_decoder_layer *l = &layers[i];
        int rc;
        ops->fused_add_rms_norm(dt, x, H, res, H, (const void *)l->input_norm, wdt, T, H, d->eps);
        rc = linear(isa, ops, d, &l->q_qkv, l->qkv, l->qkv_bias, x, H, qkv, qn, T, qn, H, s);
        if (rc) return rc;
        if (l->q_norm) {
            ops->rms_norm(dt, q, qn, q, qn, (const void *)l->q_norm, wdt, T, nh, hd, d->eps);
            ops->rms_norm(dt, k, qn, k, qn, (const void *)l->k_norm, wdt, T, nkv, hd, d->eps);
        }
        if (l->cos_sin)
            ops->rotary(dt, pos, q, qn, k, qn, (const float *)l->cos_sin, T, nh, nkv, hd,
                        d->rot_dim, d->rotary_neox);
        cpud_kv_write(k, dt, qn, (void *)l->key_cache, kvt, rot, slots, T, nkv, 0, nkv, hd,
                      d->block_size);
        cpud_kv_write(v, dt, qn, (void *)l->value_cache, kvt, rot, slots, T, nkv, 0, nkv, hd,
                      d->block_size);
        if (rot) cpud_kv_rotate_queries(rot, q, qn, q, qn, dt, T, 0, nh, hd);
        rc = ops->paged_attention(dt, kvt, rot != NULL, q, qn, (const void *)l->key_cache,
                                  (const void *)l->value_cache, qsl, sl, bt, s->max_blocks, attn,
                                  qd, s->S, nh, nkv, hd, d->block_size, d->scale, l->window,
                                  (const float *)l->sinks);
        if (rc) return rc;
        rc = linear(isa, ops, d, &l->q_o, l->o, 0, attn, qd, x, H, T, H, qd, s);
        if (rc) return rc;
        if ((rc = all_reduce(tp, dt, x, T * H, timeout_ns, peer, s))) return rc;
        if (l->o_bias) add_bias(dt, x, (const void *)l->o_bias, T, H);
        block_out(ops, d, x, l->attn_out_norm, T);
        ops->fused_add_rms_norm(dt, x, H, res, H, (const void *)l->post_norm, wdt, T, H, d->eps);
        if (l->moe) {
            rc = cpud_moe_layer_ops(ops, isa, dt, (const cpud_moe *)l->moe, x, x, T);
        } else {
            rc = linear(isa, ops, d, &l->q_gate_up, l->gate_up, 0, x, H, gu, 2 * I, T, 2 * I, H,
                        s);
            if (rc) return rc;
            if (d->activation == 1)
                ops->gelu_tanh_and_mul(dt, gu, 2 * I, act, I, T, I, I);
            else
                ops->silu_and_mul(dt, gu, 2 * I, act, I, T, I, I);
            rc = linear(isa, ops, d, &l->q_down, l->down, 0, act, I, x, H, T, H, I, s);
        }
        if (rc) return rc;
        if ((rc = all_reduce(tp, dt, x, T * H, timeout_ns, peer, s))) return rc;
        block_out(ops, d, x, l->ffn_out_norm, T);
    }
    return CPUD_OK;
}
