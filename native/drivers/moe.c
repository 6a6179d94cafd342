/* cpud_moe_experts (cpud_native.h): a step's routed experts.  The T x k (token, expert) pairs
 * are grouped by expert (ascending, tokens in order within each); every expert with tokens
 * runs its gate/up GEMM, silu * mul and down GEMM once over its gathered rows, so only the
 * routed experts' weights are read; the combine pass then sums each token's k weighted outputs
 * into out in ascending expert order, rounding as transformers' index_add does (exact in
 * fp32, bf16 steps for bf16). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch.h"
#include "moe.h"

static int64_t packed_elems(int64_t n, int64_t k) {
    return (n + CPUD_GEMM_NB - 1) / CPUD_GEMM_NB * ((k + 1) / 2) * CPUD_GEMM_NB * 2;
}

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

/* out[t] = sum over t's slots, ascending expert, of weight * y[row of the slot]. */
static void combine(int dt, const float *y, const int64_t *row_of, const int32_t *ids,
                    const float *w, int64_t T, int64_t k, int64_t H, void *out) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        int64_t order[CPUD_MOE_MAX_K];
        for (int64_t j = 0; j < k; j++) {
            int64_t i = j;
            while (i > 0 && ids[t * k + order[i - 1]] > ids[t * k + j]) {
                order[i] = order[i - 1];
                i--;
            }
            order[i] = j;
        }
        void *dst = (char *)out + t * H * dtype_size(dt);
        for (int64_t h = 0; h < H; h++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < k; j++) {
                const int64_t slot = t * k + order[j];
                const float v = rnd1(y[row_of[slot] * H + h], dt);
                acc = rnd1(acc + rnd1(v * w[slot], dt), dt);
            }
            st1(dst, h, acc, dt);
        }
    }
}

static int moe_dims_ok(int dtype, int64_t T, int64_t H, int64_t I, int64_t E, int64_t k) {
    return (dtype == CPUD_F32 || dtype == CPUD_BF16) && T >= 0 && H >= 1 && I >= 1 && E >= 1 &&
           k >= 1 && k <= CPUD_MOE_MAX_K && k <= E;
}

static int experts(const cpud_ops *ops, int dtype, const void *x, int64_t T, int64_t H,
                   int64_t I, const uint16_t *gate_up, const uint16_t *down, int64_t E,
                   const float *weights, const int32_t *id, int64_t k, void *out) {
    const int64_t pairs = T * k;
    if (T == 0) return CPUD_OK;

    const int es = dtype_size(dtype);
    const int64_t gus = packed_elems(2 * I, H), ds = packed_elems(H, I);
    int64_t *start = malloc((size_t)(E + 1) * sizeof *start);
    int64_t *rows = malloc((size_t)pairs * sizeof *rows);
    int64_t *row_of = malloc((size_t)pairs * sizeof *row_of);
    char *xg = malloc((size_t)(pairs * H * es));
    char *gu = malloc((size_t)(pairs * 2 * I * es));
    char *act = malloc((size_t)(pairs * I * es));
    float *y = malloc((size_t)(pairs * H) * sizeof *y);
    int rc = CPUD_ENOMEM;
    if (!start || !rows || !row_of || !xg || !gu || !act || !y) goto done;
    group_by_expert(id, pairs, E, start, rows);
    if (start[E] != pairs) goto done; /* the grouping's scratch could not be allocated */
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < pairs; r++) {
        row_of[rows[r]] = r;
        memcpy(xg + r * H * es, (const char *)x + rows[r] / k * H * es, (size_t)(H * es));
    }
    /* every routed expert's gate/up, one silu * mul over all rows, every routed expert's down */
    rc = CPUD_OK;
    for (int64_t e = 0; e < E && !rc; e++) {
        const int64_t r0 = start[e], n = start[e + 1] - r0;
        if (n > 0)
            rc = ops->gemm_packed(xg + r0 * H * es, dtype, H, gate_up + e * gus, NULL, CPUD_F32,
                                  gu + r0 * 2 * I * es, dtype, 2 * I, n, 2 * I, H);
    }
    if (!rc) ops->silu_and_mul(dtype, gu, 2 * I, act, I, pairs, I);
    for (int64_t e = 0; e < E && !rc; e++) {
        const int64_t r0 = start[e], n = start[e + 1] - r0;
        if (n > 0)
            rc = ops->gemm_packed(act + r0 * I * es, dtype, I, down + e * ds, NULL, CPUD_F32,
                                  y + r0 * H, CPUD_F32, H, n, H, I);
    }
    if (!rc)
        combine(dtype, y, row_of, id, weights, T, k, H, out);
done:
    free(start);
    free(rows);
    free(row_of);
    free(xg);
    free(gu);
    free(act);
    free(y);
    return rc;
}

int cpud_moe_experts(int isa, int dtype, intptr_t x, int64_t T, int64_t H, int64_t I,
                     intptr_t gate_up, intptr_t down, int64_t E, intptr_t weights, intptr_t ids,
                     int64_t k, intptr_t out) {
    const cpud_ops *ops = cpud_ops_for(isa);
    if (!ops) return CPUD_EISA;
    if (!moe_dims_ok(dtype, T, H, I, E, k) || !gate_up || !down ||
        (T > 0 && (!x || !weights || !ids || !out)))
        return CPUD_EARG;
    const int32_t *id = (const int32_t *)ids;
    for (int64_t p = 0; p < T * k; p++)
        if (id[p] < 0 || id[p] >= E) return CPUD_EARG;
    return experts(ops, dtype, (const void *)x, T, H, I, (const uint16_t *)gate_up,
                   (const uint16_t *)down, E, (const float *)weights, id, k, (void *)out);
}

/* For each token: softmax (fp32) over its E router logits, the k largest (ties: the lower
 * id first), renormalised over the k (CPUD_MOE_RENORMALIZE), rounded to dt
 * (CPUD_MOE_WEIGHTS_IN_DTYPE) - transformers' routers. */
static void route(int dt, const void *logits, int64_t T, int64_t E, int64_t k, int flags,
                  float *w, int32_t *ids) {
#pragma omp parallel for schedule(static) if (T > 16)
    for (int64_t t = 0; t < T; t++) {
        const void *row = (const char *)logits + t * E * dtype_size(dt);
        float top[CPUD_MOE_MAX_K];
        int32_t *id = ids + t * k;
        float mx = ld1(row, 0, dt), sum = 0.0f, picked = 0.0f;
        for (int64_t e = 1; e < E; e++) mx = fmaxf(mx, ld1(row, e, dt));
        for (int64_t e = 0; e < E; e++) sum += expf(ld1(row, e, dt) - mx);
        int64_t n = 0;
        for (int64_t e = 0; e < E; e++) {
            const float p = expf(ld1(row, e, dt) - mx) / sum;
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
        for (int64_t j = 0; j < k; j++) picked += top[j];
        for (int64_t j = 0; j < k; j++) {
            const float v = flags & CPUD_MOE_RENORMALIZE ? top[j] / picked : top[j];
            w[t * k + j] = flags & CPUD_MOE_WEIGHTS_IN_DTYPE ? rnd1(v, dt) : v;
        }
    }
}

int cpud_moe_ffn_ops(const cpud_ops *ops, int dtype, const void *x, void *out, int64_t T,
                     int64_t H, int64_t I, int64_t E, int64_t k, int flags,
                     const uint16_t *router, const uint16_t *gate_up, const uint16_t *down) {
    if (!moe_dims_ok(dtype, T, H, I, E, k) || !router || !gate_up || !down) return CPUD_EARG;
    if (T == 0) return CPUD_OK;
    char *logits = malloc((size_t)(T * E * dtype_size(dtype)));
    float *w = malloc((size_t)(T * k) * sizeof *w);
    int32_t *ids = malloc((size_t)(T * k) * sizeof *ids);
    int rc = CPUD_ENOMEM;
    if (logits && w && ids) {
        rc = ops->gemm_packed(x, dtype, H, router, NULL, CPUD_F32, logits, dtype, E, T, E, H);
        if (!rc) {
            route(dtype, logits, T, E, k, flags, w, ids);
            rc = experts(ops, dtype, x, T, H, I, gate_up, down, E, w, ids, k, out);
        }
    }
    free(logits);
    free(w);
    free(ids);
    return rc;
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
