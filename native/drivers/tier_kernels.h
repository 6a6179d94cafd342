/* Tier-generic kernels, included once per tier after a simd_*.h header that
 * defines TGT (the tier's target attribute), VW (floats per vector) and the
 * vf_* operations.  Every function carries TGT; dtype arguments are constants
 * after inlining, so each dtype gets its own specialised loop. */

#include <stdlib.h>

#include <omp.h>

#include "work_ranges.h"

/* ---------------------------------------------------------------- access */

/* p: [>= i + VW] of dt */
static ALWAYS_INLINE TGT vf ldv(const void *p, int64_t i, int dt) {
    return dt == CPUD_BF16 ? vf_ld_bf16((const uint16_t *)p + i) : vf_ld((const float *)p + i);
}

/* p: [>= i + VW] of dt */
static ALWAYS_INLINE TGT void stv(void *p, int64_t i, vf v, int dt) {
    if (dt == CPUD_BF16)
        vf_st_bf16((uint16_t *)p + i, v);
    else
        vf_st((float *)p + i, v);
}

static ALWAYS_INLINE TGT vf rndv(vf v, int dt) { return dt == CPUD_BF16 ? vf_rnd_bf16(v) : v; }

/* Address of element i of a dt array. */
static ALWAYS_INLINE void *at(const void *p, int64_t i, int dt) {
    return (char *)p + i * dtype_size(dt);
}

/* src: [n] of dt -> dst: [n] f32, times scale */
static ALWAYS_INLINE TGT void to_f32(const void *src, float *dst, int64_t n, float scale, int dt) {
    const vf s = vf_set1(scale);
    int64_t i = 0;
    for (; i + VW <= n; i += VW) vf_st(dst + i, vf_mul(ldv(src, i, dt), s));
    for (; i < n; i++) dst[i] = ld1(src, i, dt) * scale;
}

/* a, b: [n] f32 -> sum a*b */
static ALWAYS_INLINE TGT float dot_f32(const float *a, const float *b, int64_t n) {
    vf acc0 = vf_zero(), acc1 = vf_zero();
    int64_t i = 0;
    for (; i + 2 * VW <= n; i += 2 * VW) {
        acc0 = vf_fma(vf_ld(a + i), vf_ld(b + i), acc0);
        acc1 = vf_fma(vf_ld(a + i + VW), vf_ld(b + i + VW), acc1);
    }
    for (; i + VW <= n; i += VW) acc0 = vf_fma(vf_ld(a + i), vf_ld(b + i), acc0);
    float s = vf_hsum(vf_add(acc0, acc1));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* a: [n] f32, b: 4 rows [4][bs] f32 (stride bs) -> out[i] = sum a * b[i]: four independent
 * chains, so a score costs FMA throughput, not a chain's latency */
static ALWAYS_INLINE TGT void dot4_f32(const float *a, const float *b, int64_t bs, int64_t n,
                                       float *out) {
    vf acc0 = vf_zero(), acc1 = vf_zero(), acc2 = vf_zero(), acc3 = vf_zero();
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
        const vf x = vf_ld(a + i);
        acc0 = vf_fma(x, vf_ld(b + i), acc0);
        acc1 = vf_fma(x, vf_ld(b + bs + i), acc1);
        acc2 = vf_fma(x, vf_ld(b + 2 * bs + i), acc2);
        acc3 = vf_fma(x, vf_ld(b + 3 * bs + i), acc3);
    }
    out[0] = vf_hsum(acc0);
    out[1] = vf_hsum(acc1);
    out[2] = vf_hsum(acc2);
    out[3] = vf_hsum(acc3);
    for (; i < n; i++)
        for (int r = 0; r < 4; r++) out[r] += a[i] * b[r * bs + i];
}

#include "tier_norms.h"

/* ---------------------------------------------------------------- rotary */

/* x: [>= rot] one head, c, s: [rot/2] f32 -> rotate halves in place */
static ALWAYS_INLINE TGT void rope_neox_head(void *x, const float *c, const float *s, int64_t rot,
                                             int dt) {
    const int64_t half = rot / 2;
    int64_t i = 0;
    for (; i + VW <= half; i += VW) {
        vf x1 = ldv(x, i, dt), x2 = ldv(x, half + i, dt);
        vf vc = vf_ld(c + i), vs = vf_ld(s + i);
        stv(x, i, vf_sub(vf_mul(x1, vc), vf_mul(x2, vs)), dt);
        stv(x, half + i, vf_fma(x1, vs, vf_mul(x2, vc)), dt);
    }
    for (; i < half; i++) {
        float x1 = ld1(x, i, dt), x2 = ld1(x, half + i, dt);
        st1(x, i, x1 * c[i] - x2 * s[i], dt);
        st1(x, half + i, x2 * c[i] + x1 * s[i], dt);
    }
}

/* x: [>= rot] one head, cd: [rot] (cos_i, cos_i), sd: [rot] (-sin_i, sin_i) -> pairs rotated */
static ALWAYS_INLINE TGT void rope_gptj_head(void *x, const float *cd, const float *sd,
                                             int64_t rot, int dt) {
    int64_t i = 0;
#if VW > 1
    for (; i + VW <= rot; i += VW) {
        vf v = ldv(x, i, dt);
        stv(x, i, vf_fma(vf_swap_pairs(v), vf_ld(sd + i), vf_mul(v, vf_ld(cd + i))), dt);
    }
#endif
    for (; i + 1 < rot; i += 2) {
        float x0 = ld1(x, i, dt), x1 = ld1(x, i + 1, dt);
        st1(x, i, x0 * cd[i] + x1 * sd[i], dt);
        st1(x, i + 1, x1 * cd[i + 1] + x0 * sd[i + 1], dt);
    }
}

/* x: [n][hd] heads of one token, cs: [rot] f32 cos | sin of its position */
static ALWAYS_INLINE TGT void rope_token(void *x, int64_t n, int64_t hd, const float *cs,
                                         int64_t rot, int neox, int dt) {
    const int64_t half = rot / 2;
    if (neox) {
        for (int64_t h = 0; h < n; h++) rope_neox_head(at(x, h * hd, dt), cs, cs + half, rot, dt);
        return;
    }
    float cd[CPUD_ROT_MAX], sd[CPUD_ROT_MAX]; /* rot <= CPUD_ROT_MAX, checked by the caller */
    for (int64_t i = 0; i < half; i++) {
        cd[2 * i] = cd[2 * i + 1] = cs[i];
        sd[2 * i] = -cs[half + i];
        sd[2 * i + 1] = cs[half + i];
    }
    for (int64_t h = 0; h < n; h++) rope_gptj_head(at(x, h * hd, dt), cd, sd, rot, dt);
}

/* pos: [T], q: [T][nh][hd] (stride qs), k: [T][nkv][hd] (stride ks) or NULL,
 * cos_sin: [max_pos][rot] */
static TGT void rotary_k(int dt, const int64_t *pos, void *q, int64_t qs, void *k, int64_t ks,
                         const float *cos_sin, int64_t T, int64_t nh, int64_t nkv, int64_t hd,
                         int64_t rot, int neox) {
    const int64_t heads = nh + (k ? nkv : 0);
    CPUD_PAR_FOR(cpud_par_ok(T * heads * rot, T), t, T,
        const float *cs = cos_sin + pos[t] * rot;
        if (dt == CPUD_BF16) {
            rope_token(at(q, t * qs, dt), nh, hd, cs, rot, neox, CPUD_BF16);
            if (k) rope_token(at(k, t * ks, dt), nkv, hd, cs, rot, neox, CPUD_BF16);
        } else {
            rope_token(at(q, t * qs, dt), nh, hd, cs, rot, neox, CPUD_F32);
            if (k) rope_token(at(k, t * ks, dt), nkv, hd, cs, rot, neox, CPUD_F32);
        }
        );
}

#include "tier_activations.h"

/* ------------------------------------------------------------- argmax */

#define ARGMAX_BLOCK (16 * VW)

/* x: [n] of dt -> index of its first largest value.  Blocks are reduced with vector max
 * (x first: a NaN lane keeps the running value); only a block whose max beats the best so
 * far is scanned again for its index, which happens O(log n) times in random order. */
static ALWAYS_INLINE TGT int64_t argmax_row(const void *x, int64_t n, int dt) {
    float best = -INFINITY;
    int64_t idx = 0;
    for (int64_t b0 = 0; b0 < n; b0 += ARGMAX_BLOCK) {
        const int64_t b1 = n - b0 < ARGMAX_BLOCK ? n : b0 + ARGMAX_BLOCK;
        float m = -INFINITY;
        int64_t i = b0;
        if (b1 - b0 == ARGMAX_BLOCK) {
            vf acc = vf_set1(-INFINITY);
            for (; i < b1; i += VW) acc = vf_max(ldv(x, i, dt), acc);
            m = vf_hmax(acc);
        }
        for (; i < b1; i++) {
            const float v = ld1(x, i, dt);
            m = v > m ? v : m;
        }
        if (m > best) {
            best = m;
            for (i = b0; ld1(x, i, dt) != m; i++) {}
            idx = i;
        }
    }
    return idx;
}

/* x: [rows][n] (stride xs) -> out: [rows] */
static TGT void argmax_rows_k(int dt, const void *x, int64_t xs, int64_t rows, int64_t n,
                              int64_t *out) {
    CPUD_PAR_FOR(rows * n >= CPUD_PAR_MIN && rows > 1, r, rows,
        out[r] = dt == CPUD_BF16 ? argmax_row(at(x, r * xs, dt), n, CPUD_BF16)
                                 : argmax_row(at(x, r * xs, dt), n, CPUD_F32);
    );
}

/* ------------------------------------------------------ paged attention */

#include "tier_kv.h"

#include "att_plan.h"

/* Rows per group of the tiled block path: 6 rows x 16 keys (or 16 dims) of accumulators, the
 * GEMM micro-kernel's shape; it runs when hd and bs are multiples of 16. */
#define ATT_MR 6
#define ATT_NC (16 / VW) /* vectors per 16 keys or dims */

/* Keys [*jlo, *jhi] that any query of an item attends (causal, sliding window, the item's
 * share [k0, k1]); *jlo = INT32_MAX and *jhi = -1 when none. */
static ALWAYS_INLINE void att_item_keys(const att_item *it, const int32_t *qsl,
                                        const int32_t *seq_lens, int64_t window, int64_t *jlo,
                                        int64_t *jhi) {
    const int64_t p_first = seq_lens[it->s] - (qsl[it->s + 1] - qsl[it->s]) + it->q0;
    const int64_t hi = p_first + it->nq - 1;
    const int64_t lo = att_window_start(p_first, window);
    *jlo = lo > it->k0 ? lo : it->k0;
    *jhi = hi < it->k1 ? hi : it->k1;
    if (*jlo > *jhi) {
        *jlo = INT32_MAX;
        *jhi = -1;
    }
}

/* Row r's keys [*lo, *hi]: query position p's (causal, sliding window) within the item's
 * share; *lo > *hi when none. */
static ALWAYS_INLINE void att_row_keys(const att_item *it, int64_t p, int64_t window,
                                       int64_t *lo, int64_t *hi) {
    const int64_t first = att_window_start(p, window);
    *lo = first > it->k0 ? first : it->k0;
    *hi = p < it->k1 ? p : it->k1;
}

/* Per-thread workspace for items of up to R rows (R = max(ATT_ROWS, G)). */
typedef struct att_ws {
    float *q;    /* [R][hd] scaled queries, fp32 */
    float *acc;  /* [R][hd] unnormalised outputs */
    float *m;    /* [R] running max */
    float *l;    /* [R] running sum */
    float *p;    /* [ATT_MR][bs] scores / probabilities of a row group */
    float *kt;   /* [hd][bs] keys of one block transposed, fp32 (tiled path) */
    float *kb;   /* [bs][hd] keys of one block, fp32 */
    float *vb;   /* [bs][hd] values of one block, fp32 */
    int64_t *lo; /* [R] first key each row attends */
    int64_t *hi; /* [R] last key each row attends */
} att_ws;

static att_ws att_ws_alloc(int64_t R, int64_t hd, int64_t bs) {
    att_ws w;
    const size_t floats =
        ((size_t)(R * hd * 2 + R * 2 + ATT_MR * bs + 3 * bs * hd) + 1) & ~(size_t)1;
    w.q = malloc(sizeof(float) * floats + sizeof(int64_t) * (size_t)(2 * R));
    w.acc = w.q ? w.q + R * hd : NULL;
    w.m = w.q ? w.acc + R * hd : NULL;
    w.l = w.q ? w.m + R : NULL;
    w.p = w.q ? w.l + R : NULL;
    w.kt = w.q ? w.p + ATT_MR * bs : NULL;
    w.kb = w.q ? w.kt + bs * hd : NULL;
    w.vb = w.q ? w.kb + bs * hd : NULL;
    w.lo = w.q ? (int64_t *)(void *)(w.q + floats) : NULL;
    w.hi = w.q ? w.lo + R : NULL;
    return w;
}

static void att_ws_free(att_ws *w) {
    free(w->q);
    w->q = NULL;
}

/* acc: [hd] = acc * alpha + sum_j p[j] * vb[j], j in [a, b]; vb: [bs][hd] */
static ALWAYS_INLINE TGT void att_pv(float *acc, float alpha, const float *p, const float *vb,
                                     int64_t a, int64_t b, int64_t hd) {
    const vf va = vf_set1(alpha);
    int64_t d = 0;
    for (; d + VW <= hd; d += VW) {
        vf o = vf_mul(vf_ld(acc + d), va);
        for (int64_t j = a; j <= b; j++) o = vf_fma(vf_set1(p[j]), vf_ld(vb + j * hd + d), o);
        vf_st(acc + d, o);
    }
    for (; d < hd; d++) {
        float o = acc[d] * alpha;
        for (int64_t j = a; j <= b; j++) o += p[j] * vb[j * hd + d];
        acc[d] = o;
    }
}

/* p: [>= b+1] scores -> exp(p - mx) in place over [a, b]; returns their sum */
static ALWAYS_INLINE TGT float att_exp(float *p, int64_t a, int64_t b, float mx) {
    const vf vm = vf_set1(mx);
    vf sum = vf_zero();
    int64_t j = a;
    for (; j + VW <= b + 1; j += VW) {
        vf e = vf_exp(vf_sub(vf_ld(p + j), vm));
        vf_st(p + j, e);
        sum = vf_add(sum, e);
    }
    float s = vf_hsum(sum);
    for (; j <= b; j++) {
        p[j] = expf(p[j] - mx);
        s += p[j];
    }
    return s;
}

/* p[a..b]: a row's scores of one block -> exp(p - m_new) in place; folds them into the row's
 * running max *m and sum *l and returns alpha, the factor that rescales its earlier output */
static ALWAYS_INLINE TGT float att_online_softmax(float *p, int64_t a, int64_t b, float *m,
                                                  float *l) {
    float mx = -INFINITY;
    for (int64_t j = a; j <= b; j++) mx = p[j] > mx ? p[j] : mx;
    const float m_new = mx > *m ? mx : *m;
    const float alpha = *m == -INFINITY ? 0.0f : expf(*m - m_new);
    *l = *l * alpha + att_exp(p, a, b, m_new);
    *m = m_new;
    return alpha;
}

/* One block of keys [j0, j0 + nk) against all rows of an item. kb, vb: [bs][hd]
 * fp32 (only rows [ka, kb_end] valid), lo/hi: [rows] attended key range. */
static ALWAYS_INLINE TGT void att_block(att_ws *w, const float *kb, const float *vb, int64_t j0,
                                        int64_t nk, const int64_t *lo, const int64_t *hi,
                                        int64_t rows, int64_t hd) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t a = (lo[r] > j0 ? lo[r] : j0) - j0;
        const int64_t b = (hi[r] < j0 + nk - 1 ? hi[r] : j0 + nk - 1) - j0;
        if (a > b) continue;
        const float *qr = w->q + r * hd;
        int64_t j = a;
        for (; j + 4 <= b + 1; j += 4) dot4_f32(qr, kb + j * hd, hd, hd, w->p + j);
        for (; j <= b; j++) w->p[j] = dot_f32(qr, kb + j * hd, hd);
        const float alpha = att_online_softmax(w->p, a, b, w->m + r, w->l + r);
        att_pv(w->acc + r * hd, alpha, w->p, vb, a, b, hd);
    }
}

/* acc[r][c] += a[r * as] * b[c * VW] for mr rows and the ATT_NC vectors at b: one step of the
 * 6 x 16 tiles below */
static ALWAYS_INLINE TGT void att_rank1(const int mr, vf acc[ATT_MR][ATT_NC], const float *a,
                                        int64_t as, const float *b) {
    vf bv[ATT_NC];
    for (int c = 0; c < ATT_NC; c++) bv[c] = vf_ld(b + c * VW);
    for (int r = 0; r < mr; r++) {
        const vf ar = vf_set1(a[r * as]);
        for (int c = 0; c < ATT_NC; c++) acc[r][c] = vf_fma(ar, bv[c], acc[r][c]);
    }
}

/* s[r][0..16) = q[r] . keys [j0, j0 + 16) for mr rows; q: [mr][hd], kt: [hd][bs], s: [mr][bs] */
static ALWAYS_INLINE TGT void att_scores_tile(const int mr, const float *q, const float *kt,
                                              int64_t j0, int64_t hd, int64_t bs, float *s) {
    vf acc[ATT_MR][ATT_NC];
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < ATT_NC; c++) acc[r][c] = vf_zero();
    for (int64_t d = 0; d < hd; d++) att_rank1(mr, acc, q + d, hd, kt + d * bs + j0);
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < ATT_NC; c++) vf_st(s + r * bs + j0 + c * VW, acc[r][c]);
}

/* acc[r] = acc[r] * alpha[r] + sum_{j in [a, b]} p[r][j] * vb[j] for mr rows;
 * acc: [mr][hd], p: [mr][bs], vb: [bs][hd] */
static ALWAYS_INLINE TGT void att_pv_tile(const int mr, float *acc, const float *alpha,
                                          const float *p, const float *vb, int64_t a, int64_t b,
                                          int64_t hd, int64_t bs) {
    for (int64_t d0 = 0; d0 < hd; d0 += 16) {
        vf o[ATT_MR][ATT_NC];
        for (int r = 0; r < mr; r++) {
            const vf al = vf_set1(alpha[r]);
            for (int c = 0; c < ATT_NC; c++)
                o[r][c] = vf_mul(vf_ld(acc + r * hd + d0 + c * VW), al);
        }
        for (int64_t j = a; j <= b; j++) att_rank1(mr, o, p + j, bs, vb + j * hd + d0);
        for (int r = 0; r < mr; r++)
            for (int c = 0; c < ATT_NC; c++) vf_st(acc + r * hd + d0 + c * VW, o[r][c]);
    }
}

/* One row group [r0, r0 + mr) of an item against keys [j0 + ka, j0 + ke] of a block whose keys
 * are transposed in w->kt and values are vb ([bs][hd] fp32); lo/hi: [rows] attended range. */
static ALWAYS_INLINE TGT void att_group_tile(const int mr, att_ws *w, const float *vb, int64_t j0,
                                             int64_t ka, int64_t ke, const int64_t *lo,
                                             const int64_t *hi, int64_t r0, int64_t hd,
                                             int64_t bs) {
    int64_t ga = ke + 1, gb = ka - 1; /* keys any row of the group attends, block-relative */
    int64_t ra[ATT_MR], rb[ATT_MR];
    for (int r = 0; r < mr; r++) {
        ra[r] = (lo[r0 + r] > j0 + ka ? lo[r0 + r] : j0 + ka) - j0;
        rb[r] = (hi[r0 + r] < j0 + ke ? hi[r0 + r] : j0 + ke) - j0;
        if (ra[r] <= rb[r]) {
            ga = ra[r] < ga ? ra[r] : ga;
            gb = rb[r] > gb ? rb[r] : gb;
        }
    }
    if (ga > gb) return;
    const float *q = w->q + r0 * hd;
    for (int64_t c0 = ga / 16 * 16; c0 <= gb; c0 += 16) att_scores_tile(mr, q, w->kt, c0, hd, bs, w->p);
    float alpha[ATT_MR];
    for (int r = 0; r < mr; r++) {
        float *p = w->p + r * bs;
        float *m = w->m + r0 + r, *l = w->l + r0 + r;
        if (ra[r] > rb[r]) { /* this row sees none of these keys: p = 0, nothing rescaled */
            for (int64_t j = ga; j <= gb; j++) p[j] = 0.0f;
            alpha[r] = 1.0f;
            continue;
        }
        alpha[r] = att_online_softmax(p, ra[r], rb[r], m, l);
        for (int64_t j = ga; j < ra[r]; j++) p[j] = 0.0f;
        for (int64_t j = rb[r] + 1; j <= gb; j++) p[j] = 0.0f;
    }
    att_pv_tile(mr, w->acc + r0 * hd, alpha, w->p, vb, ga, gb, hd, bs);
}

static TGT void att_group_tiles(int mr, att_ws *w, const float *vb, int64_t j0, int64_t ka,
                                int64_t ke, const int64_t *lo, const int64_t *hi, int64_t r0,
                                int64_t hd, int64_t bs) {
    switch (mr) {
#define ATT_CASE(n)                                                                                \
    case n: att_group_tile(n, w, vb, j0, ka, ke, lo, hi, r0, hd, bs); break;
    ATT_CASE(1)
    ATT_CASE(2)
    ATT_CASE(3)
    ATT_CASE(4)
    ATT_CASE(5)
    ATT_CASE(6)
#undef ATT_CASE
    default: break;
    }
}

/* Runs one work item: queries [q0, q0 + nq) of sequence s against kv head kvh; the caches
 * hold rows of kvt (kv_formats.h), in kv_hadamard's basis where rot is set (q too; the output
 * is rotated back), sinks: [nh] f32 or NULL. */
static ALWAYS_INLINE TGT void att_item_run(
    att_ws *w, const att_item *it, const void *q /* [T][nh][hd] stride qs */, int64_t qs,
    const void *kc /* [nb][nkv][bs] rows */, const void *vc /* [nb][nkv][bs] rows */,
    const int32_t *qsl /* [S+1] */, const int32_t *seq_lens /* [S] */,
    const int32_t *bt /* [S][max_blocks] */, int64_t max_blocks,
    void *out /* [T][nh][hd] stride os */, int64_t os, int64_t nh, int64_t nkv, int64_t hd,
    int64_t bs, float scale, int64_t window, const float *sinks, int kvt, int rot, int dt) {
    const int64_t G = nh / nkv, rows = (int64_t)it->nq * G;
    const int64_t q_len = qsl[it->s + 1] - qsl[it->s], ctx = seq_lens[it->s];
    const int64_t t0 = qsl[it->s] + it->q0;
    int64_t *lo = w->lo, *hi = w->hi;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t qi = r / G, h = it->kvh * G + r % G;
        att_row_keys(it, ctx - q_len + it->q0 + qi, window, lo + r, hi + r);
        to_f32(at(q, (t0 + qi) * qs + h * hd, dt), w->q + r * hd, hd, scale, dt);
        memset(w->acc + r * hd, 0, sizeof(float) * (size_t)hd);
        /* a sink is a key of logit sinks[h] and value 0: the softmax starts from it (in a
         * split's first part) */
        w->m[r] = sinks && it->part == 0 ? sinks[h] : -INFINITY;
        w->l[r] = sinks && it->part == 0 ? 1.0f : 0.0f;
    }
    const int64_t rb = kv_row_bytes(kvt, hd);
    /* the caches' rows are read in place when they hold dt, else converted into w->kb, w->vb */
    const int direct = kvt == dt;
    int64_t jlo, jhi;
    att_item_keys(it, qsl, seq_lens, window, &jlo, &jhi);
    /* the tiled path needs whole 16-wide key chunks and dims; it pays from a few rows on */
    const int tiled = hd % 16 == 0 && bs % 16 == 0 && rows >= 4;
    for (int64_t blk = jlo / bs; blk <= jhi / bs; blk++) {
        const int64_t phys = bt[it->s * max_blocks + blk], j0 = blk * bs;
        const int64_t ka = (jlo > j0 ? jlo : j0) - j0;
        const int64_t ke = (jhi < j0 + bs - 1 ? jhi : j0 + bs - 1) - j0;
        const int64_t base = (phys * nkv + it->kvh) * bs * hd;
        const char *krow0 = kv_row(kc, phys, it->kvh, 0, nkv, bs, rb);
        const char *vrow0 = kv_row(vc, phys, it->kvh, 0, nkv, bs, rb);
        const float *kb, *vb;
        if (tiled) {
            /* keys [ka, ke] transposed into kt, values as fp32 rows (converted if bf16) */
            if (direct) {
                for (int64_t j = ka; j <= ke; j++)
                    for (int64_t d = 0; d < hd; d++)
                        w->kt[d * bs + j] = ld1(kc, base + j * hd + d, dt);
            } else {
                kv_rows_f32(krow0, rb, kvt, dt, ka, ke, hd, w->kb);
                for (int64_t j = ka; j <= ke; j++)
                    for (int64_t d = 0; d < hd; d++) w->kt[d * bs + j] = w->kb[j * hd + d];
            }
            if (direct && dt == CPUD_F32)
                vb = (const float *)vc + base;
            else if (direct) {
                to_f32(at(vc, base + ka * hd, dt), w->vb + ka * hd, (ke - ka + 1) * hd, 1.0f, dt);
                vb = w->vb;
            } else {
                kv_rows_f32(vrow0, rb, kvt, dt, ka, ke, hd, w->vb);
                vb = w->vb;
            }
            for (int64_t r0 = 0; r0 < rows; r0 += ATT_MR)
                att_group_tiles((int)(rows - r0 < ATT_MR ? rows - r0 : ATT_MR), w, vb, j0, ka, ke,
                                lo, hi, r0, hd, bs);
            continue;
        }
        if (direct && dt == CPUD_F32) {
            kb = (const float *)kc + base;
            vb = (const float *)vc + base;
        } else if (direct) {
            to_f32(at(kc, base + ka * hd, dt), w->kb + ka * hd, (ke - ka + 1) * hd, 1.0f, dt);
            to_f32(at(vc, base + ka * hd, dt), w->vb + ka * hd, (ke - ka + 1) * hd, 1.0f, dt);
            kb = w->kb;
            vb = w->vb;
        } else {
            kv_rows_f32(krow0, rb, kvt, dt, ka, ke, hd, w->kb);
            kv_rows_f32(vrow0, rb, kvt, dt, ka, ke, hd, w->vb);
            kb = w->kb;
            vb = w->vb;
        }
        att_block(w, kb, vb, j0, ke + 1, lo, hi, rows, hd);
    }
    if (it->nparts > 1 && !att_part_finish(it, rows, hd, w->acc, hd, w->m, w->l)) return;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t qi = r / G, h = it->kvh * G + r % G;
        const float inv = w->l[r] > 0.0f ? 1.0f / w->l[r] : 0.0f;
        void *o = at(out, (t0 + qi) * os + h * hd, dt);
        float *a = w->acc + r * hd;
        const vf vinv = vf_set1(inv);
        int64_t d = 0;
        if (rot) { /* normalised, then back from the rows' basis */
            for (; d + VW <= hd; d += VW) vf_st(a + d, vf_mul(vf_ld(a + d), vinv));
            for (; d < hd; d++) a[d] *= inv;
            hadamard_rows_k(a, 1, hd, 1);
            for (d = 0; d + VW <= hd; d += VW) stv(o, d, vf_ld(a + d), dt);
            for (; d < hd; d++) st1(o, d, a[d], dt);
            continue;
        }
        for (; d + VW <= hd; d += VW) stv(o, d, vf_mul(vf_ld(a + d), vinv), dt);
        for (; d < hd; d++) st1(o, d, a[d] * inv, dt);
    }
}

#if TIER_ID >= 3
#include "tier_flash_bf16.h"
#endif

/* Arguments as cpud_paged_attention (kvt: the caches' kv_dtype): the items of plan (built for
 * these query_start_loc and heads) that thread tid takes, its own range first; no parallel
 * region: every thread of the caller's team calls it once.  Returns 0 or CPUD_ENOMEM (no
 * workspace: the items this thread took are not computed).
 * The caller has validated query_start_loc, seq_lens and every block id that is read. */
static TGT int paged_attention_part_k(int dt, int kvt, int rot, const void *q, int64_t qs,
                                      const void *kc, const void *vc, const int32_t *qsl,
                                      const int32_t *seq_lens, const int32_t *bt,
                                      int64_t max_blocks, void *out, int64_t os, int64_t nh,
                                      int64_t nkv, int64_t hd, int64_t bs, float scale,
                                      int64_t window, const float *sinks, const att_plan *plan,
                                      int tid) {
    const int64_t G = nh / nkv, n_items = plan->n;
    const att_item *items = plan->items;
    work_range *ranges = plan->ranges;
    const int nr = plan->nr;
    if (n_items == 0) return CPUD_OK;
    int failed = 0;
    {
#if TIER_ID >= 3
        /* bf16 flash path (tier_flash_bf16.h) for every item when the shapes allow */
        const int fa = fa_usable(dt, hd, bs);
        const fa_cache fc = {kc, vc, kv_row_bytes(kvt, hd), kvt, rot};
        fa_ws fw = {0};
        if (fa) {
            const int64_t R = G > ATT_ROWS ? G : ATT_ROWS;
            fw = fa_ws_alloc((R + FA_LANES - 1) / FA_LANES, hd);
            if (!fw.mem) failed = 1;
        }
        int64_t warm_item = -1; /* the item the previous one prefetched into */
#else
        const int fa = 0;
#endif
        att_ws w = {0};
        if (!fa) {
            w = att_ws_alloc(G > ATT_ROWS ? G : ATT_ROWS, hd, bs);
            if (!w.q) failed = 1;
        }
        /* last items first (each range, and the steals from its back last): later query tiles
         * of a sequence see more keys */
        for (int64_t ii; (ii = work_next(ranges, nr, tid)) >= 0;) {
            const int64_t i = n_items - 1 - ii;
#if TIER_ID >= 3
            if (fa) {
                if (!fw.mem) continue;
                const int64_t rows = items[i].nq * G;
                /* the next item of this thread's own range, unless another thread takes it */
                fa_stream st = {NULL, 0, 0, ii == warm_item};
                if (work_owns(n_items, nr, tid, ii) && work_has_after(&ranges[tid], ii)) {
                    st.next = &items[i - 1];
                    att_item_keys(st.next, qsl, seq_lens, window, &st.next_lo, &st.next_hi);
                }
                /* an item with keys prefetches the next one's first chunks (fa_pf_plan) */
                int64_t jlo, jhi;
                att_item_keys(&items[i], qsl, seq_lens, window, &jlo, &jhi);
                warm_item = st.next && jlo <= jhi ? ii + 1 : -1;
                if (rows >= FA_MIN_ROWS)
                    fa_item_run(&fw, &items[i], q, qs, &fc, qsl, seq_lens, bt, max_blocks, out,
                                os, nh, nkv, hd, bs, scale, window, sinks, &st);
                else
                    fa_item_run_few(&fw, &items[i], q, qs, &fc, qsl, seq_lens, bt, max_blocks,
                                    out, os, nh, nkv, hd, bs, scale, window, sinks, (int)rows,
                                    &st);
                continue;
            }
#endif
            if (!w.q) continue;
            if (dt == CPUD_BF16)
                att_item_run(&w, &items[i], q, qs, kc, vc, qsl, seq_lens, bt, max_blocks, out, os,
                             nh, nkv, hd, bs, scale, window, sinks, kvt, rot, CPUD_BF16);
            else
                att_item_run(&w, &items[i], q, qs, kc, vc, qsl, seq_lens, bt, max_blocks, out, os,
                             nh, nkv, hd, bs, scale, window, sinks, kvt, rot, CPUD_F32);
        }
        if (!fa) att_ws_free(&w);
#if TIER_ID >= 3
        if (fa) fa_ws_free(&fw);
#endif
    }
    return failed ? CPUD_ENOMEM : CPUD_OK;
}

/* Arguments as cpud_paged_attention (kvt: the caches' kv_dtype); returns 0 or CPUD_ENOMEM:
 * paged_attention_part_k in its own parallel region. */
static TGT int paged_attention_k(int dt, int kvt, int rot, const void *q, int64_t qs,
                                 const void *kc, const void *vc, const int32_t *qsl,
                                 const int32_t *seq_lens,
                                 const int32_t *bt, int64_t max_blocks, void *out, int64_t os,
                                 int64_t S, int64_t nh, int64_t nkv, int64_t hd, int64_t bs,
                                 float scale, int64_t window, const float *sinks) {
    /* one range per thread the region may get; ranges of threads it does not get are stolen */
    const int nr = omp_get_max_threads();
    att_plan plan;
    if (att_plan_new(qsl, seq_lens, S, nh, nkv, hd, window, nr, &plan)) return CPUD_ENOMEM;
    if (plan.n == 0) return CPUD_OK;
    int failed = 0;
#pragma omp parallel if (plan.n > 1) reduction(| : failed)
    {
        const int tid = omp_get_thread_num() < nr ? omp_get_thread_num() : 0;
        failed |= paged_attention_part_k(dt, kvt, rot, q, qs, kc, vc, qsl, seq_lens, bt,
                                         max_blocks, out, os, nh, nkv, hd, bs, scale, window,
                                         sinks, &plan, tid) != CPUD_OK;
    }
    att_plan_free(&plan);
    return failed ? CPUD_ENOMEM : CPUD_OK;
}
