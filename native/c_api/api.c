/* Public entry points (cpud_native.h): argument and index validation, then a
 * call into the kernel table of the requested tier.  Index data (positions,
 * slots, block tables) is checked here so a bad step plan returns CPUD_EARG
 * instead of touching memory out of bounds. */
#include <omp.h>
#include <stdlib.h>

#include "att_plan.h"
#include "dispatch.h"
#include "kv_formats.h"
#include "step_checks.h"

#define ADDR(p) ((void *)(p))
#define CADDR(p) ((const void *)(p))

static int dtype_ok(int dt) { return dt == CPUD_F32 || dt == CPUD_BF16; }

int cpud_max_threads(void) { return omp_get_max_threads(); }

/* A norm weight of w_dtype may scale rows of dtype: the same dtype, or f32 (Gemma form). */
static int norm_dtypes_ok(int dtype, int w_dtype) {
    return dtype_ok(dtype) && (w_dtype == dtype || w_dtype == CPUD_F32);
}

int cpud_rms_norm(int isa, int dtype, intptr_t x, int64_t x_stride, intptr_t out,
                  int64_t out_stride, intptr_t w, int w_dtype, int64_t T, int64_t n, int64_t H,
                  float eps) {
    const cpud_ops *ops = cpud_ops_for(isa);
    if (!ops) return CPUD_EISA;
    if (!norm_dtypes_ok(dtype, w_dtype) || !x || !out || !w || T < 0 || n < 1 || H < 1)
        return CPUD_EARG;
    ops->rms_norm(dtype, CADDR(x), x_stride, ADDR(out), out_stride, CADDR(w), w_dtype, T, n, H,
                  eps);
    return CPUD_OK;
}

int cpud_fused_add_rms_norm(int isa, int dtype, intptr_t x, int64_t x_stride, intptr_t residual,
                            int64_t r_stride, intptr_t w, int w_dtype, int64_t T, int64_t H,
                            float eps) {
    const cpud_ops *ops = cpud_ops_for(isa);
    if (!ops) return CPUD_EISA;
    if (!norm_dtypes_ok(dtype, w_dtype) || !x || !residual || !w || T < 0 || H < 1)
        return CPUD_EARG;
    ops->fused_add_rms_norm(dtype, ADDR(x), x_stride, ADDR(residual), r_stride, CADDR(w), w_dtype,
                            T, H, eps);
    return CPUD_OK;
}

int cpud_rotary_embedding(int isa, int dtype, intptr_t positions, intptr_t q, int64_t q_stride,
                          intptr_t k, int64_t k_stride, intptr_t cos_sin, int64_t T, int64_t nh,
                          int64_t nkv, int64_t hd, int64_t rot_dim, int64_t max_pos, int neox) {
    const cpud_ops *ops = cpud_ops_for(isa);
    if (!ops) return CPUD_EISA;
    if (!dtype_ok(dtype) || !positions || !q || !cos_sin || T < 0 || nh < 1 || hd < 1)
        return CPUD_EARG;
    if (rot_dim < 2 || rot_dim % 2 || rot_dim > hd || rot_dim > CPUD_ROT_MAX) return CPUD_EARG;
    if (k && nkv < 1) return CPUD_EARG;
    const int64_t *pos = (const int64_t *)positions;
    if (!cpud_positions_ok(pos, T, max_pos)) return CPUD_EARG;
    ops->rotary(dtype, pos, ADDR(q), q_stride, ADDR(k), k_stride, (const float *)cos_sin, T, nh,
                nkv, hd, rot_dim, neox);
    return CPUD_OK;
}

int cpud_silu_and_mul(int isa, int dtype, intptr_t x, int64_t x_stride, intptr_t out,
                      int64_t out_stride, int64_t T, int64_t I) {
    const cpud_ops *ops = cpud_ops_for(isa);
    if (!ops) return CPUD_EISA;
    if (!dtype_ok(dtype) || !x || !out || T < 0 || I < 1) return CPUD_EARG;
    ops->silu_and_mul(dtype, CADDR(x), x_stride, ADDR(out), out_stride, T, I, I);
    return CPUD_OK;
}

int cpud_gelu_tanh_and_mul(int isa, int dtype, intptr_t x, int64_t x_stride, intptr_t out,
                           int64_t out_stride, int64_t T, int64_t I) {
    const cpud_ops *ops = cpud_ops_for(isa);
    if (!ops) return CPUD_EISA;
    if (!dtype_ok(dtype) || !x || !out || T < 0 || I < 1) return CPUD_EARG;
    ops->gelu_tanh_and_mul(dtype, CADDR(x), x_stride, ADDR(out), out_stride, T, I, I);
    return CPUD_OK;
}

int cpud_argmax_rows(int isa, int dtype, intptr_t x, int64_t x_stride, int64_t rows, int64_t n,
                     intptr_t out) {
    const cpud_ops *ops = cpud_ops_for(isa);
    if (!ops) return CPUD_EISA;
    if (!dtype_ok(dtype) || !x || !out || rows < 0 || n < 1 || (rows > 1 && x_stride < n))
        return CPUD_EARG;
    ops->argmax_rows(dtype, CADDR(x), x_stride, rows, n, (int64_t *)out);
    return CPUD_OK;
}

int cpud_positions_ok(const int64_t *pos, int64_t T, int64_t max_pos) {
    for (int64_t t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= max_pos) return 0;
    return 1;
}

int cpud_slots_ok(const int64_t *slots, int64_t T, int64_t capacity) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] >= capacity) return 0;
    return 1;
}

void cpud_kv_scatter(const char *src, int64_t ss, char *cache, const int64_t *slots, int64_t T,
                     int64_t nkv, int64_t h0, int64_t h1, int64_t hd, int64_t bs, int es) {
    const size_t row = (size_t)(hd * es);
    CPUD_PAR_FOR(cpud_par_ok(T * (h1 - h0) * hd, T), t, T,
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const int64_t b = slot / bs, o = slot % bs;
        for (int64_t h = h0; h < h1; h++)
            memcpy(cache + ((b * nkv + h) * bs + o) * hd * es, src + (t * ss + h * hd) * es, row);
        );
}

void cpud_kv_write(const void *src, int dt, int64_t ss, void *cache, int kvt, cpud_rotate_fn rot,
                   const int64_t *slots, int64_t T, int64_t nkv, int64_t h0, int64_t h1,
                   int64_t hd, int64_t bs) {
    if (kvt == dt) {
        cpud_kv_scatter(src, ss, cache, slots, T, nkv, h0, h1, hd, bs, dtype_size(dt));
        return;
    }
    const int64_t rb = kv_row_bytes(kvt, hd);
    CPUD_PAR_FOR(cpud_par_ok(T * (h1 - h0) * hd, T), t, T,
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        float rows[(h1 - h0) * hd];
        for (int64_t i = 0; i < (h1 - h0) * hd; i++) rows[i] = ld1(src, t * ss + h0 * hd + i, dt);
        if (rot && kvt != CPUD_BF16) rot(rows, h1 - h0, hd, 0);
        for (int64_t h = h0; h < h1; h++) {
            const float *x = rows + (h - h0) * hd;
            char *dst = (char *)cache + ((slot / bs * nkv + h) * bs + slot % bs) * rb;
            if (kvt == CPUD_BF16) {
                for (int64_t i = 0; i < hd; i++) ((uint16_t *)dst)[i] = f32_to_bf16(x[i]);
            } else {
                kv_quantize_row(x, hd, kvt, dst);
            }
        }
        );
}

void cpud_kv_rotate_queries(cpud_rotate_fn rot, const void *q, int64_t qs, void *out, int64_t os,
                            int dt, int64_t T, int64_t h0, int64_t h1, int64_t hd) {
    const int64_t n = (h1 - h0) * hd;
    if (n <= 0) return;
    CPUD_PAR_FOR(cpud_par_ok(T * n, T), t, T,
        float x[n];
        for (int64_t i = 0; i < n; i++) x[i] = ld1(q, t * qs + h0 * hd + i, dt);
        rot(x, h1 - h0, hd, 1);
        for (int64_t i = 0; i < n; i++) st1(out, t * os + h0 * hd + i, x[i], dt);
        );
}

int cpud_write_kv_cache(int isa, int dtype, int kv_dtype, intptr_t key, intptr_t value,
                        int64_t key_stride, int64_t value_stride, intptr_t key_cache,
                        intptr_t value_cache, intptr_t slot_mapping, int64_t T, int64_t nkv,
                        int64_t hd, int64_t num_blocks, int64_t bs, int kv_rotated) {
    const cpud_ops *ops = cpud_ops_for(isa);
    if (!ops) return CPUD_EISA;
    if (!dtype_ok(dtype) || !kv_pair_ok(dtype, kv_dtype) || !key || !value || !key_cache ||
        !value_cache || !slot_mapping || T < 0 || nkv < 1 || hd < 1 || bs < 1 || num_blocks < 0)
        return CPUD_EARG;
    const int64_t *slots = (const int64_t *)slot_mapping;
    if (!cpud_slots_ok(slots, T, num_blocks * bs)) return CPUD_EARG;
    const cpud_rotate_fn rot = kv_rotated ? cpud_kv_rotation(ops, kv_dtype) : NULL;
    cpud_kv_write(CADDR(key), dtype, key_stride, ADDR(key_cache), kv_dtype, rot, slots, T, nkv, 0,
                  nkv, hd, bs);
    cpud_kv_write(CADDR(value), dtype, value_stride, ADDR(value_cache), kv_dtype, rot, slots, T,
                  nkv, 0, nkv, hd, bs);
    return CPUD_OK;
}

int cpud_attention_plan_ok(const int32_t *qsl, const int32_t *seq_lens, const int32_t *bt,
                           int64_t max_blocks, int64_t T, int64_t S, int64_t num_blocks,
                           int64_t bs, int64_t window) {
    if (S > 0 && (qsl[0] < 0 || qsl[S] > T)) return 0;
    for (int64_t s = 0; s < S; s++) {
        const int64_t q_len = (int64_t)qsl[s + 1] - qsl[s], ctx = seq_lens[s];
        if (q_len < 0 || (q_len > 0 && ctx < q_len)) return 0;
        if (q_len == 0) continue;
        const int64_t p0 = ctx - q_len;
        const int64_t lo = att_window_start(p0, window);
        if ((ctx - 1) / bs >= max_blocks) return 0;
        for (int64_t blk = lo / bs; blk <= (ctx - 1) / bs; blk++) {
            const int32_t b = bt[s * max_blocks + blk];
            if (b < 0 || b >= num_blocks) return 0;
        }
    }
    return 1;
}

int64_t cpud_attention_items(intptr_t query_start_loc, intptr_t seq_lens, int64_t S, int64_t nh,
                             int64_t nkv, int64_t hd, int64_t sliding_window) {
    const int32_t *qsl = CADDR(query_start_loc), *sl = CADDR(seq_lens);
    if (!qsl || (S > 0 && !sl) || S < 0 || nkv < 1 || nh < 1 || nh % nkv || hd < 1 ||
        sliding_window < 0)
        return CPUD_EARG;
    for (int64_t s = 0; s < S; s++)
        if (qsl[s + 1] < qsl[s] || sl[s] < qsl[s + 1] - qsl[s]) return CPUD_EARG;
    att_plan plan;
    if (att_plan_new(qsl, sl, S, nh, nkv, hd, sliding_window, 1, &plan)) return CPUD_ENOMEM;
    const int64_t n = plan.n;
    att_plan_free(&plan);
    return n;
}

int cpud_paged_attention(int isa, int dtype, int kv_dtype, intptr_t query, int64_t q_stride,
                         intptr_t key_cache, intptr_t value_cache, intptr_t query_start_loc,
                         intptr_t seq_lens, intptr_t block_tables, int64_t max_blocks,
                         intptr_t out, int64_t out_stride, int64_t T, int64_t S, int64_t nh,
                         int64_t nkv, int64_t hd, int64_t num_blocks, int64_t bs, float scale,
                         int64_t sliding_window, intptr_t sinks, int kv_rotated) {
    const cpud_ops *ops = cpud_ops_for(isa);
    if (!ops) return CPUD_EISA;
    if (!dtype_ok(dtype) || !kv_pair_ok(dtype, kv_dtype) || !query || !key_cache || !value_cache || !query_start_loc ||
        !seq_lens || !out || (S > 0 && !block_tables) || T < 0 || S < 0 || nkv < 1 ||
        nh % nkv || hd < 1 || bs < 1 || max_blocks < 0 || sliding_window < 0)
        return CPUD_EARG;
    const int32_t *qsl = (const int32_t *)query_start_loc, *sl = (const int32_t *)seq_lens;
    const int32_t *bt = (const int32_t *)block_tables;
    if (!cpud_attention_plan_ok(qsl, sl, bt, max_blocks, T, S, num_blocks, bs, sliding_window))
        return CPUD_EARG;
    /* the query rows attention reads, rotated into the rows' basis (kv_formats.h): a copy */
    const cpud_rotate_fn rot = kv_rotated ? cpud_kv_rotation(ops, kv_dtype) : NULL;
    const void *q = CADDR(query);
    void *rotated = NULL;
    const int64_t rows = S > 0 ? qsl[S] : 0;
    if (rot && rows > 0) {
        if (!(rotated = malloc((size_t)(rows * nh * hd * dtype_size(dtype))))) return CPUD_ENOMEM;
        cpud_kv_rotate_queries(rot, q, q_stride, rotated, nh * hd, dtype, rows, 0, nh, hd);
        q = rotated;
        q_stride = nh * hd;
    }
    const int rc = ops->paged_attention(dtype, kv_dtype, rot != NULL, q, q_stride, CADDR(key_cache),
                                        CADDR(value_cache), qsl, sl, bt, max_blocks, ADDR(out),
                                        out_stride, S, nh, nkv, hd, bs, scale, sliding_window,
                                        (const float *)sinks);
    free(rotated);
    return rc;
}

int cpud_gemm_packed(int isa, intptr_t x, int x_dtype, int64_t x_stride, intptr_t packed,
                     intptr_t bias, int bias_dtype, intptr_t out, int out_dtype,
                     int64_t out_stride, int64_t M, int64_t N, int64_t K) {
    const cpud_ops *ops = cpud_ops_for(isa);
    if (!ops) return CPUD_EISA;
    if (!dtype_ok(x_dtype) || !dtype_ok(out_dtype) || (bias && !dtype_ok(bias_dtype)) || !x ||
        !packed || !out || M < 0 || N < 1 || K < 1)
        return CPUD_EARG;
    if (M == 0) return CPUD_OK;
    return ops->gemm_packed(CADDR(x), x_dtype, x_stride, (const uint16_t *)packed, CADDR(bias),
                            bias_dtype, ADDR(out), out_dtype, out_stride, M, N, K);
}

/* Lanes [l0, l1) of one panel from rows w (row stride ws, lane l0 first) ->
 * dst [nkp][32] pairs (as uint32). */
static void pack_lanes(const void *w, int dt, int64_t ws, int l0, int l1, int64_t K,
                       uint32_t *dst) {
    const int64_t nkp = (K + 1) / 2;
    for (int lane = l0; lane < l1; lane++) {
        if (dt == CPUD_BF16) {
            const uint16_t *row = (const uint16_t *)w + (lane - l0) * ws;
            for (int64_t kp = 0; kp < K / 2; kp++) {
                uint32_t pair;
                memcpy(&pair, row + 2 * kp, sizeof pair);
                dst[kp * CPUD_GEMM_NB + lane] = pair;
            }
            if (K % 2) dst[(nkp - 1) * CPUD_GEMM_NB + lane] = row[K - 1];
        } else {
            const float *row = (const float *)w + (lane - l0) * ws;
            for (int64_t kp = 0; kp < nkp; kp++) {
                const uint32_t lo = f32_to_bf16(row[2 * kp]);
                const uint32_t hi = 2 * kp + 1 < K ? f32_to_bf16(row[2 * kp + 1]) : 0;
                dst[kp * CPUD_GEMM_NB + lane] = lo | hi << 16;
            }
        }
    }
}

int cpud_pack_rows(intptr_t w, int w_dtype, int64_t w_stride, intptr_t packed, int64_t K,
                   int64_t row0, int64_t nrows) {
    if (!dtype_ok(w_dtype) || !w || !packed || K < 1 || w_stride < K || row0 < 0 || nrows < 0)
        return CPUD_EARG;
    const int64_t p0 = row0 / CPUD_GEMM_NB, p1 = (row0 + nrows + CPUD_GEMM_NB - 1) / CPUD_GEMM_NB;
    const int64_t panel = (K + 1) / 2 * CPUD_GEMM_NB;
    const int es = dtype_size(w_dtype);
#pragma omp parallel for schedule(static) if (p1 - p0 > 1)
    for (int64_t p = p0; p < p1; p++) {
        const int64_t first = p * CPUD_GEMM_NB > row0 ? p * CPUD_GEMM_NB : row0;
        const int64_t end = (p + 1) * CPUD_GEMM_NB < row0 + nrows ? (p + 1) * CPUD_GEMM_NB
                                                                   : row0 + nrows;
        pack_lanes((const char *)CADDR(w) + (first - row0) * w_stride * es, w_dtype, w_stride,
                   (int)(first - p * CPUD_GEMM_NB), (int)(end - p * CPUD_GEMM_NB), K,
                   (uint32_t *)ADDR(packed) + p * panel);
    }
    return CPUD_OK;
}

uint64_t cpud_read_probe(int isa, intptr_t buf, int64_t bytes) {
    const cpud_ops *ops = cpud_ops_for(isa);
    if (!ops || !buf || bytes % 4096 || buf % 64) return 0;
    return ops->read_probe(CADDR(buf), bytes);
}

double cpud_compute_probe(int isa, int64_t iters) {
    const cpud_ops *ops = cpud_ops_for(isa);
    if (!ops || iters < 0) return -1.0;
    float sink; /* compute_probe stores its results' sum: nothing is optimised away */
    return ops->compute_probe(iters, &sink);
}
