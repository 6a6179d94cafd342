/* Flash-style paged attention for the AVX512-BF16 tier, bf16 activations and a bf16 or
 * quantized (int8, e5m2, e4m3: converted to bf16 16 keys at a time; decode on int8 and e4m3 in
 * tier_flash_int8.h and tier_flash_e4m3.h) KV cache (prefill and decode).  Included by tier_kernels.h only when TIER_ID >= 3, after att_item.
 *
 * Items of >= FA_MIN_ROWS rows (prefill): the rows of a work item (queries x the
 * G heads of one kv head) sit in the 16 lanes of a vector ("row group"), so
 * every softmax step is vertical:
 *   S^T[key][row]   = sum_dp  Qt[dp][row] . bcast(K[key][dp])        (vdpbf16ps)
 *   O[row][d]      += sum_kp  Vp[kp][d]  . bcast(P[kp][row])         (vdpbf16ps)
 * where dp indexes bf16 pairs (d, d+1) of the head dimension and kp pairs of
 * consecutive keys (2kp, 2kp+1).  K is read straight from the cache (its pairs
 * are contiguous dwords) and each key broadcast feeds up to three row groups.
 * Items with fewer rows (decode) compute scores per row with d in lanes and a
 * 16-key reduction (fa_item_run_few), then the same value product.
 *
 * Both: V is re-laid per chunk of 32 keys as key pairs, with rows outside the
 * item's key range zeroed (cache slots past the sequence may hold NaN
 * patterns), and scores outside a row's range are masked before the max.
 * Scores, softmax state (m, l) and O accumulate in fp32; P is rounded to bf16
 * for the value product. */

#define FA_LANES 16
#define FA_CHUNK 32 /* keys per step: two sub-chunks of 16, each inside one block */
#ifndef FA_PF_DIST
#define FA_PF_DIST 2 /* chunks of keys and values prefetched ahead */
#endif
/* Fewest rows (queries x G) for which an item takes the row-group path; items
 * with fewer (decode: 1 query x G heads, short chunks) take fa_item_run_few,
 * which computes scores per row with keys in lanes.  Measured on decode items:
 * few-row path 1.3x faster at 8 rows, on par at 16. */
#define FA_MIN_ROWS 17

_Static_assert(FA_MIN_ROWS <= FA_LANES + 1, "fa_item_run_few holds at most 16 rows");

/* CALL(N) with N the constant equal to n (1..3, or 1..4), so the always-inline kernels CALL
 * runs compile once per count. */
#define FA_FOR_1TO3(n, CALL)      \
    do {                          \
        if ((n) == 3) {           \
            CALL(3)               \
        } else if ((n) == 2) {    \
            CALL(2)               \
        } else {                  \
            CALL(1)               \
        }                         \
    } while (0)
#define FA_FOR_1TO4(n, CALL)      \
    do {                          \
        if ((n) == 4) {           \
            CALL(4)               \
        } else {                  \
            FA_FOR_1TO3(n, CALL); \
        }                         \
    } while (0)

static ALWAYS_INLINE int fa_usable(int dt, int64_t hd, int64_t bs) {
    return dt == CPUD_BF16 && hd % 16 == 0 && bs % 16 == 0;
}

/* The caches an item reads: rows of rb bytes of kvt (kv_formats.h).  bf16 rows are read in
 * place; quantized keys are converted, 16 at a time, into bf16 rows of the workspace
 * (fa_ws.kst) and quantized values straight into the value pairs, after which every step is
 * the bf16 one. */
typedef struct fa_cache {
    const void *k, *v; /* [nb][nkv][bs] rows */
    int64_t rb;
    int kvt;
    int rot; /* quantized rows in kv_hadamard's basis: outputs are rotated back */
} fa_cache;

/* Per-thread workspace for items of up to ng row groups; every array 64-byte aligned. */
typedef struct fa_ws {
    uint32_t *qt; /* [ng][hd/2][16] query pairs, rows in lanes */
    float *o;     /* [ng * 16][hd] unnormalised outputs */
    float *m;     /* [ng][16] running max */
    float *l;     /* [ng][16] running sum */
    int32_t *lo;  /* [ng][16] first key each row attends (INT32_MAX: padding lane) */
    int32_t *hi;  /* [ng][16] last key each row attends (-1: padding lane) */
    float *s;     /* [ng][FA_CHUNK][16] scores of one chunk, transposed */
    uint32_t *p;  /* [FA_CHUNK/2][16] bf16 probability pairs of one chunk */
    uint32_t *vp; /* [FA_CHUNK/2][hd] bf16 value pairs of one chunk */
    float *alpha; /* [16] output rescale factors of one group and chunk */
    uint16_t *kst; /* [2][16][hd] bf16 keys of one chunk read from a quantized cache */
    void *mem;
} fa_ws;

static fa_ws fa_ws_alloc(int64_t ng, int64_t hd) {
    fa_ws w;
    const size_t v = 64; /* bytes per vector */
    const size_t sz[] = {
        (size_t)(ng * hd / 2) * v, (size_t)(ng * 16 * hd) * 4, (size_t)ng * v,
        (size_t)ng * v,            (size_t)ng * v,        (size_t)ng * v,
        (size_t)(ng * FA_CHUNK) * v, FA_CHUNK / 2 * v,      (size_t)(FA_CHUNK / 2 * hd) * 4,
        v,                           (size_t)(FA_CHUNK * hd) * 2,
    };
    size_t total = 0;
    for (size_t i = 0; i < sizeof sz / sizeof sz[0]; i++) total += (sz[i] + 63) & ~(size_t)63;
    char *m = aligned_alloc(64, total);
    w.mem = m;
    void *ptr[sizeof sz / sizeof sz[0]];
    for (size_t i = 0; i < sizeof sz / sizeof sz[0]; i++) {
        ptr[i] = m;
        if (m) m += (sz[i] + 63) & ~(size_t)63;
    }
    w.qt = ptr[0];
    w.o = ptr[1];
    w.m = ptr[2];
    w.l = ptr[3];
    w.lo = ptr[4];
    w.hi = ptr[5];
    w.s = ptr[6];
    w.p = ptr[7];
    w.vp = ptr[8];
    w.alpha = ptr[9];
    w.kst = ptr[10];
    return w;
}

static void fa_ws_free(fa_ws *w) {
    free(w->mem);
    w->mem = NULL;
}

/* r[16] -> transposed in place: r[i] lane j <- r[j] lane i. */
static ALWAYS_INLINE TGT void fa_tr16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    /* u[4a + e], e < 4: rows 4a..4a+3, element e + 4L in 128-bit lane L */
    for (int a = 0; a < 4; a++) {
        __m512d t0 = _mm512_castps_pd(t[4 * a]), t1 = _mm512_castps_pd(t[4 * a + 1]);
        __m512d t2 = _mm512_castps_pd(t[4 * a + 2]), t3 = _mm512_castps_pd(t[4 * a + 3]);
        u[4 * a] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
        u[4 * a + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
        u[4 * a + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
        u[4 * a + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
    }
    for (int e = 0; e < 4; e++) {
        __m512 v0 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x88);
        __m512 v1 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xdd);
        __m512 v2 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x88);
        __m512 v3 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xdd);
        r[e] = _mm512_shuffle_f32x4(v0, v2, 0x88);
        r[e + 8] = _mm512_shuffle_f32x4(v0, v2, 0xdd);
        r[e + 4] = _mm512_shuffle_f32x4(v1, v3, 0x88);
        r[e + 12] = _mm512_shuffle_f32x4(v1, v3, 0xdd);
    }
}

/* s[g]: [8][16] = S^T of 8 keys (k: [8][hp] key pairs) against NG row groups
 * (qt[g]: [hp][16]); each key broadcast feeds NG products. */
static ALWAYS_INLINE TGT void fa_scores8(const uint32_t *const *qt, const uint32_t *k, int64_t hp,
                                         float *const *s, int NG) {
    __m512 acc[3][8];
    for (int g = 0; g < NG; g++)
        for (int j = 0; j < 8; j++) acc[g][j] = _mm512_setzero_ps();
    for (int64_t dp = 0; dp < hp; dp++) {
        __m512bh qv[3];
        for (int g = 0; g < NG; g++) qv[g] = (__m512bh)_mm512_load_si512(qt[g] + dp * FA_LANES);
        for (int j = 0; j < 8; j++) {
            const __m512bh kb = (__m512bh)_mm512_set1_epi32((int)k[j * hp + dp]);
            for (int g = 0; g < NG; g++) acc[g][j] = _mm512_dpbf16_ps(acc[g][j], qv[g], kb);
        }
    }
    for (int g = 0; g < NG; g++)
        for (int j = 0; j < 8; j++) _mm512_store_ps(s[g] + j * FA_LANES, acc[g][j]);
}

/* Scores of keys [0, nk) (k[u]: [16][hp] key pairs of sub-chunk u) against the
 * row groups listed in gs (qt: [ng][hp][16]) into s: [ng][FA_CHUNK][16]. */
static ALWAYS_INLINE TGT void fa_scores(const uint32_t *qt, const uint32_t *const *k, int nk,
                                        const int *gs, int n, int64_t hp, float *s) {
    for (int i = 0; i < n; i += 3) {
        const int NG = n - i < 3 ? n - i : 3;
        const uint32_t *q[3];
        for (int g = 0; g < NG; g++) q[g] = qt + gs[i + g] * hp * FA_LANES;
        for (int j = 0; j < nk; j += 8) {
            const uint32_t *kj = k[j / 16] + (j % 16) * hp;
            float *sg[3];
            for (int g = 0; g < NG; g++) sg[g] = s + (gs[i + g] * FA_CHUNK + j) * FA_LANES;
            /* constant head sizes make the key row offsets immediates */
#define FA_S(NGC)                                      \
    if (hp == 64)                                      \
        fa_scores8(q, kj, 64, sg, NGC);                \
    else if (hp == 32)                                 \
        fa_scores8(q, kj, 32, sg, NGC);                \
    else                                               \
        fa_scores8(q, kj, hp, sg, NGC);
            FA_FOR_1TO3(NG, FA_S);
#undef FA_S
        }
    }
}

/* o: [RT][hd] rows (row stride hd) = o * alpha[i] (when rescale) + sum_kp vp[kp] . p(kp, i),
 * kp < nkp; p(kp, i) = p[kp * pk + i * pr] bf16 pairs; vp: [nkp][hd] value pairs.
 * NV (<= 8 / RT vectors of 16 d) per pass keeps the RT x NV accumulators in registers. */
static ALWAYS_INLINE TGT void fa_pv_rows(float *o, const float *alpha, int rescale,
                                         const uint32_t *p, int64_t pk, int64_t pr,
                                         const uint32_t *vp, int64_t nkp, int64_t hd, int RT,
                                         int NV) {
    for (int64_t d0 = 0; d0 < hd; d0 += 16 * NV) {
        __m512 acc[3][8];
        for (int i = 0; i < RT; i++)
            for (int v = 0; v < NV; v++) {
                acc[i][v] = _mm512_loadu_ps(o + i * hd + d0 + 16 * v);
                if (rescale) acc[i][v] = _mm512_mul_ps(acc[i][v], _mm512_set1_ps(alpha[i]));
            }
        for (int64_t kp = 0; kp < nkp; kp++) {
            __m512bh b[3];
            for (int i = 0; i < RT; i++)
                b[i] = (__m512bh)_mm512_set1_epi32((int)p[kp * pk + i * pr]);
            for (int v = 0; v < NV; v++) {
                const __m512bh vv = (__m512bh)_mm512_loadu_si512(vp + kp * hd + d0 + 16 * v);
                for (int i = 0; i < RT; i++) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], vv, b[i]);
            }
        }
        for (int i = 0; i < RT; i++)
            for (int v = 0; v < NV; v++) _mm512_storeu_ps(o + i * hd + d0 + 16 * v, acc[i][v]);
    }
}

/* Value product of up to 16 rows with the keys of this chunk (active: rows
 * with any such key; the others have p = 0 and alpha = 1, so skipping them is
 * exact). o: [live][hd] the rows, alpha: [live], p as in fa_pv_rows. */
static ALWAYS_INLINE TGT void fa_pv(float *o, const float *alpha, int rescale, const uint32_t *p,
                                   int64_t pk, int64_t pr, const uint32_t *vp, int64_t nkp,
                                   int64_t hd, int live, __mmask16 active) {
    const int64_t nv = hd / 16;
    const int NV = nv % 8 == 0 ? 8 : nv == 5 ? 5 : nv == 4 ? 4 : 1;
    for (int r = 0; r < live;) {
        const int rt = live - r < 3 ? live - r : 3;
        if (!((active >> r) & ((1u << rt) - 1))) {
            r += rt;
            continue;
        }
        float *orow = o + r * hd;
        const uint32_t *pr0 = p + r * pr;
        const float *ar = alpha + r;
#define FA_PV_NV(RT)                                                  \
    if (NV == 8)                                                      \
        fa_pv_rows(orow, ar, rescale, pr0, pk, pr, vp, nkp, hd, RT, 8);        \
    else if (NV == 5)                                                 \
        fa_pv_rows(orow, ar, rescale, pr0, pk, pr, vp, nkp, hd, RT, 5);        \
    else if (NV == 4)                                                 \
        fa_pv_rows(orow, ar, rescale, pr0, pk, pr, vp, nkp, hd, RT, 4);        \
    else                                                              \
        fa_pv_rows(orow, ar, rescale, pr0, pk, pr, vp, nkp, hd, RT, 1);
        FA_FOR_1TO3(rt, FA_PV_NV);
#undef FA_PV_NV
        r += rt;
    }
}

/* Online-softmax step of one row group over keys [j0, j0 + nk) whose scores
 * (unscaled) are in s: [nk][16].  Writes p: [nk/2][16] bf16 pairs and alpha:
 * [16] (the factor for the old outputs), updates m, l; *rescale = 0 when every
 * alpha is 1.  Returns the lanes that attend any key of the chunk. */
static ALWAYS_INLINE TGT __mmask16 fa_softmax(const float *s, uint32_t *p, float *alpha_out,
                                              float *m, float *l, const int32_t *lo,
                                              const int32_t *hi, int64_t j0, int nk, float scale,
                                              int *rescale) {
    const __m512i vlo = _mm512_load_si512(lo), vhi = _mm512_load_si512(hi);
    const vf vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    __mmask16 msk[FA_CHUNK];
    vf mx = ninf;
    __mmask16 active = 0;
    for (int j = 0; j < nk; j++) {
        const __m512i jv = _mm512_set1_epi32((int)(j0 + j));
        msk[j] = _mm512_mask_cmple_epi32_mask(_mm512_cmple_epi32_mask(vlo, jv), jv, vhi);
        active |= msk[j];
        const vf sj = _mm512_mul_ps(_mm512_load_ps(s + j * FA_LANES), vscale);
        mx = _mm512_mask_max_ps(mx, msk[j], mx, sj);
    }
    const vf m_old = _mm512_load_ps(m), m_new = _mm512_max_ps(m_old, mx);
    const __mmask16 grew = _mm512_cmp_ps_mask(m_new, m_old, _CMP_NEQ_UQ);
    /* lanes with no key so far keep alpha 0 (their outputs are still 0) */
    const __mmask16 seen = _mm512_cmp_ps_mask(m_old, ninf, _CMP_NEQ_UQ);
    vf alpha = _mm512_set1_ps(1.0f);
    *rescale = (grew & seen) != 0;
    if (*rescale) alpha = _mm512_mask_blend_ps(grew, alpha, vf_exp(_mm512_sub_ps(m_old, m_new)));
    alpha = _mm512_maskz_mov_ps(seen, alpha);
    const __m512i ilv = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
    vf sum = _mm512_setzero_ps();
    for (int j = 0; j < nk; j += 2) {
        const vf se = _mm512_load_ps(s + j * FA_LANES);
        const vf so = _mm512_load_ps(s + (j + 1) * FA_LANES);
        const vf pe = _mm512_maskz_mov_ps(msk[j], vf_exp(_mm512_fmsub_ps(se, vscale, m_new)));
        const vf po = _mm512_maskz_mov_ps(msk[j + 1], vf_exp(_mm512_fmsub_ps(so, vscale, m_new)));
        sum = _mm512_add_ps(sum, _mm512_add_ps(pe, po));
        /* [pe lanes 0..15 | po lanes 0..15] bf16 -> (pe[r], po[r]) pairs */
        const __m512i pp = (__m512i)_mm512_cvtne2ps_pbh(po, pe);
        _mm512_store_si512(p + j / 2 * FA_LANES, _mm512_permutexvar_epi16(ilv, pp));
    }
    _mm512_store_ps(l, _mm512_fmadd_ps(_mm512_load_ps(l), alpha, sum));
    _mm512_store_ps(m, m_new);
    _mm512_store_ps(alpha_out, alpha);
    return active;
}

/* Key and value rows to prefetch into L2 while the current chunk computes: up to
 * FA_PF_STREAMS streams of 64-byte lines, taken `per` lines a step in order.  Prefetching a
 * whole chunk at once (256 lines) left decode reading the cache at 15-20 GB/s; spread over
 * the value re-layout and the scores it reads at 22-31 GB/s (32 sequences x 512-2048 keys,
 * 2 cores). */
#define FA_PF_STREAMS (4 * FA_PF_DIST)
typedef struct fa_pf {
    const char *base[FA_PF_STREAMS];
    int32_t lines[FA_PF_STREAMS];
    int n;       /* streams */
    int s;       /* current stream */
    int32_t at;  /* its next line */
    int32_t per; /* lines per step */
} fa_pf;

/* Adds the key and value rows of keys [j0, min(j0 + FA_CHUNK - 1, jhi)] of item it. */
static ALWAYS_INLINE void fa_pf_add(fa_pf *pf, const att_item *it, const int32_t *bt,
                                    int64_t max_blocks, const fa_cache *c, int64_t nkv,
                                    int64_t bs, int64_t j0, int64_t jhi) {
    for (int64_t j = j0; j < j0 + FA_CHUNK && j <= jhi && pf->n + 2 <= FA_PF_STREAMS; j += 16) {
        const int64_t phys = bt[it->s * max_blocks + j / bs];
        const int64_t bytes = (jhi - j + 1 < 16 ? jhi - j + 1 : 16) * c->rb;
        for (int kv = 0; kv < 2; kv++) {
            const uintptr_t from =
                (uintptr_t)kv_row(kv ? c->v : c->k, phys, it->kvh, j % bs, nkv, bs, c->rb);
            pf->base[pf->n] = (const char *)(from & ~(uintptr_t)63);
            pf->lines[pf->n++] = (int32_t)(((from & 63) + (uintptr_t)bytes + 63) / 64);
        }
    }
}

/* Spreads the planned lines over `steps` calls of fa_pf_step. */
static ALWAYS_INLINE void fa_pf_spread(fa_pf *pf, int steps) {
    int32_t total = 0;
    for (int i = 0; i < pf->n; i++) total += pf->lines[i];
    pf->s = 0;
    pf->at = 0;
    pf->per = (total + steps - 1) / steps;
}

/* Prefetches the next `per` planned lines. */
static ALWAYS_INLINE void fa_pf_step(fa_pf *pf) {
    for (int32_t left = pf->per; left > 0 && pf->s < pf->n;) {
        const int32_t room = pf->lines[pf->s] - pf->at, take = left < room ? left : room;
        for (int32_t i = 0; i < take; i++)
            __builtin_prefetch(pf->base[pf->s] + 64 * (int64_t)(pf->at + i), 0, 2);
        left -= take;
        pf->at += take;
        if (pf->at == pf->lines[pf->s]) {
            pf->s++;
            pf->at = 0;
        }
    }
}

/* 16-bit interleave of rows a, b by _mm512_permutex2var_epi16(a, perm, b): dword i = (a[i], b[i])
 * for i < 16 (*lo) and 16..31 (*hi). */
static ALWAYS_INLINE TGT void fa_pair_perms(__m512i *lo, __m512i *hi) {
    *lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                           6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    *hi = _mm512_add_epi16(*lo, _mm512_set1_epi16(16));
}

/* dst[0..32) = dwords (a[i], b[i]) of the 32 16-bit values of a and b (lo, hi: fa_pair_perms). */
static ALWAYS_INLINE TGT void fa_store_pairs(uint32_t *dst, __m512i a, __m512i b, __m512i lo,
                                             __m512i hi) {
    _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(a, lo, b));
    _mm512_storeu_si512(dst + 16, _mm512_permutex2var_epi16(a, hi, b));
}

/* vp: [nk/2][hd] = value pairs (V[2kp][d], V[2kp+1][d]) of keys [j0, j0 + nk)
 * (vb[u]: [16][hd] rows of sub-chunk u); rows outside [jlo, jhi] are zero.  One step of pf
 * per key pair. */
static ALWAYS_INLINE TGT void fa_value_pairs(uint32_t *vp, const uint16_t *const *vb, int64_t j0,
                                             int nk, int64_t jlo, int64_t jhi, int64_t hd,
                                             fa_pf *pf) {
    __m512i ilv_lo, ilv_hi;
    fa_pair_perms(&ilv_lo, &ilv_hi);
    for (int kp = 0; kp < nk / 2; kp++) {
        const int64_t ja = j0 + 2 * kp, jb = ja + 1;
        const uint16_t *row = vb[kp / 8] + (2 * kp % 16) * hd;
        const uint16_t *va = (ja >= jlo && ja <= jhi) ? row : NULL;
        const uint16_t *vb1 = (jb >= jlo && jb <= jhi) ? row + hd : NULL;
        uint32_t *dst = vp + kp * hd;
        fa_pf_step(pf);
        int64_t d = 0;
        for (; d + 32 <= hd; d += 32) {
            const __m512i a = va ? _mm512_loadu_si512(va + d) : _mm512_setzero_si512();
            const __m512i b = vb1 ? _mm512_loadu_si512(vb1 + d) : _mm512_setzero_si512();
            fa_store_pairs(dst + d, a, b, ilv_lo, ilv_hi);
        }
        for (; d < hd; d += 16) { /* hd % 32 == 16: last 16 columns */
            const __m256i z = _mm256_setzero_si256();
            const __m512i a =
                _mm512_cvtepu16_epi32(va ? _mm256_loadu_si256((const __m256i *)(va + d)) : z);
            const __m512i b =
                _mm512_cvtepu16_epi32(vb1 ? _mm256_loadu_si256((const __m256i *)(vb1 + d)) : z);
            _mm512_storeu_si512(dst + d, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
        }
    }
}

/* A thread's items form one stream of chunks for prefetching: near the end of an item the
 * chunks FA_PF_DIST ahead are those of the thread's next item, when it is known, so short
 * items (decode at short contexts) do not start on cold misses. */
typedef struct fa_stream {
    const att_item *next; /* the thread's next item, or NULL */
    int64_t next_lo;      /* its key range */
    int64_t next_hi;
    int warm; /* the previous item prefetched this item's first FA_PF_DIST chunks */
} fa_stream;

/* Plans pf over `steps` fa_pf_step calls at chunk j0 of an item (keys [jlo, jhi]): the chunk
 * FA_PF_DIST ahead in the stream st (a cold start first fetches the window before it). */
static ALWAYS_INLINE void fa_pf_plan(fa_pf *pf, const att_item *it, const int32_t *bt,
                                     int64_t max_blocks, const fa_cache *c, int64_t nkv,
                                     int64_t bs, int64_t j0, int64_t jlo, int64_t jhi, int steps,
                                     const fa_stream *st) {
    const int64_t first = jlo & ~(int64_t)15, i = (j0 - first) / FA_CHUNK;
    const int64_t n = (jhi - first) / FA_CHUNK + 1; /* chunks of this item */
    pf->n = 0;
    if (i == 0 && !st->warm) { /* a cold start fetches the window before it at once */
        for (int64_t k = 1; k < FA_PF_DIST; k++)
            fa_pf_add(pf, it, bt, max_blocks, c, nkv, bs, first + k * FA_CHUNK, jhi);
        fa_pf_spread(pf, 1);
        fa_pf_step(pf);
        pf->n = 0;
    }
    if (i + FA_PF_DIST < n) {
        fa_pf_add(pf, it, bt, max_blocks, c, nkv, bs, j0 + FA_PF_DIST * FA_CHUNK, jhi);
    } else if (st->next) {
        /* the next item's chunk in that place; an item of fewer than FA_PF_DIST chunks also
         * takes, at its first chunk, those no chunk of it reaches */
        const int64_t nfirst = st->next_lo & ~(int64_t)15, k_hi = i + FA_PF_DIST - n;
        for (int64_t k = i == 0 ? 0 : k_hi; k <= k_hi; k++)
            fa_pf_add(pf, st->next, bt, max_blocks, c, nkv, bs, nfirst + k * FA_CHUNK,
                      st->next_hi);
    }
    fa_pf_spread(pf, steps);
}

/* Row r of an item (query r / G of those from token t0, head kvh * G + r % G): its place in a
 * [tokens][heads][hd] array whose tokens are ts apart. */
static ALWAYS_INLINE int64_t fa_row_at(const att_item *it, int64_t t0, int64_t G, int64_t r,
                                       int64_t ts, int64_t hd) {
    return (t0 + r / G) * ts + (it->kvh * G + r % G) * hd;
}

/* dst: [hd] bf16 = o / l, zeros where l is 0 (a row that attended no key); with rot, o / l
 * rotated back from the cache's basis (kv_hadamard), o overwritten. */
static ALWAYS_INLINE TGT void fa_row_out(float *o, float l, uint16_t *dst, int64_t hd, int rot) {
    const vf inv = _mm512_set1_ps(l > 0.0f ? 1.0f / l : 0.0f);
    if (rot) {
        for (int64_t d = 0; d < hd; d += 16)
            _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), inv));
        hadamard_rows_k(o, 1, hd, 1);
        for (int64_t d = 0; d < hd; d += 16) vf_st_bf16(dst + d, _mm512_loadu_ps(o + d));
        return;
    }
    for (int64_t d = 0; d < hd; d += 16)
        vf_st_bf16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), inv));
}

/* kr[u], vr[u] (u < nsub): row 0 of the item's keys and values j0 + 16 u .. j0 + 16 u + 15,
 * each 16-key sub-chunk inside one block. */
static ALWAYS_INLINE void fa_chunk_rows(const char **kr, const char **vr, const att_item *it,
                                        const int32_t *bt, int64_t max_blocks, const fa_cache *c,
                                        int64_t nkv, int64_t bs, int64_t j0, int nsub) {
    for (int u = 0; u < nsub; u++) {
        const int64_t j = j0 + 16 * u, phys = bt[it->s * max_blocks + j / bs];
        kr[u] = kv_row(c->k, phys, it->kvh, j % bs, nkv, bs, c->rb);
        vr[u] = kv_row(c->v, phys, it->kvh, j % bs, nkv, bs, c->rb);
    }
}

#include "tier_flash_quant.h"

/* Key chunk [j0, j0 + 16 * nsub) of an item: kb gets its 16-key sub-blocks' key rows (in the
 * cache, or converted into w->kst), pf is planned over `steps` fa_pf_step calls with the chunk
 * FA_PF_DIST ahead in the stream st, and the values are re-laid as key pairs in w->vp (taking
 * nk / 2 of the steps).  Returns nsub (1 or 2). */
static ALWAYS_INLINE TGT int fa_chunk(fa_ws *w, const att_item *it, const int32_t *bt,
                                      int64_t max_blocks, const fa_cache *c, int64_t nkv,
                                      int64_t hd, int64_t bs, int64_t j0, int64_t jlo,
                                      int64_t jhi, const uint16_t **kb, fa_pf *pf, int steps,
                                      const fa_stream *st) {
    const int nsub = j0 + 16 <= jhi ? 2 : 1;
    const uint16_t *vb[2] = {NULL, NULL};
    const char *kr[2], *vr[2];
    fa_chunk_rows(kr, vr, it, bt, max_blocks, c, nkv, bs, j0, nsub);
    for (int u = 0; u < nsub; u++) {
        const int64_t j = j0 + 16 * u;
        if (c->kvt == CPUD_BF16) {
            kb[u] = (const uint16_t *)kr[u];
            vb[u] = (const uint16_t *)vr[u];
            continue;
        }
        /* only the rows the item attends: the others' scores are masked */
        const int64_t a = jlo > j ? jlo - j : 0, b = jhi < j + 15 ? jhi - j : 15;
        uint16_t *ks = w->kst + u * 16 * hd;
        fa_dequant_rows(ks, kr[u], c->rb, c->kvt, a, b, hd);
        kb[u] = ks;
    }
    fa_pf_plan(pf, it, bt, max_blocks, c, nkv, bs, j0, jlo, jhi, steps, st);
    if (c->kvt == CPUD_BF16)
        fa_value_pairs(w->vp, vb, j0, 16 * nsub, jlo, jhi, hd, pf);
    else
        fa_value_pairs_q(w->vp, vr, c->rb, c->kvt, j0, 16 * nsub, jlo, jhi, hd, pf);
    return nsub;
}

/* Runs one work item: queries [q0, q0 + nq) of sequence s against kv head kvh
 * (arguments as att_item_run; dt is bf16, hd % 16 == 0, bs % 16 == 0). */
static TGT void fa_item_run(fa_ws *w, const att_item *it, const void *q, int64_t qs,
                            const fa_cache *c, const int32_t *qsl, const int32_t *seq_lens,
                            const int32_t *bt, int64_t max_blocks, void *out, int64_t os,
                            int64_t nh, int64_t nkv, int64_t hd, int64_t bs, float scale,
                            int64_t window, const float *sinks, const fa_stream *st) {
    const int64_t G = nh / nkv, rows = (int64_t)it->nq * G, hp = hd / 2;
    const int64_t ng = (rows + FA_LANES - 1) / FA_LANES;
    const int64_t q_len = qsl[it->s + 1] - qsl[it->s], ctx = seq_lens[it->s];
    const int64_t t0 = qsl[it->s] + it->q0;
    const uint16_t *qb = q;
    int32_t glo[ng], ghi[ng]; /* key range of each row group */
    for (int64_t g = 0; g < ng; g++) {
        glo[g] = INT32_MAX;
        ghi[g] = -1;
        const uint32_t *src[FA_LANES];
        for (int64_t ln = 0; ln < FA_LANES; ln++) {
            const int64_t r = g * FA_LANES + ln;
            int32_t lo = INT32_MAX, hi = -1;
            src[ln] = NULL;
            if (r < rows) {
                int64_t rlo, rhi;
                att_row_keys(it, ctx - q_len + it->q0 + r / G, window, &rlo, &rhi);
                hi = (int32_t)rhi;
                lo = (int32_t)rlo;
                src[ln] = (const uint32_t *)(qb + fa_row_at(it, t0, G, r, qs, hd));
            }
            w->lo[g * FA_LANES + ln] = lo;
            w->hi[g * FA_LANES + ln] = hi;
            glo[g] = lo < glo[g] ? lo : glo[g];
            ghi[g] = hi > ghi[g] ? hi : ghi[g];
        }
        _mm512_store_ps(w->m + g * FA_LANES, _mm512_set1_ps(-INFINITY));
        _mm512_store_ps(w->l + g * FA_LANES, _mm512_setzero_ps());
        /* a sink is a key of logit sinks[h] and value 0: the softmax starts from it (in a
         * split's first part) */
        for (int64_t ln = 0; sinks && it->part == 0 && ln < FA_LANES && g * FA_LANES + ln < rows;
             ln++) {
            const int64_t r = g * FA_LANES + ln;
            w->m[r] = sinks[it->kvh * G + r % G];
            w->l[r] = 1.0f;
        }
        memset(w->o + g * FA_LANES * hd, 0, sizeof(float) * (size_t)(FA_LANES * hd));
        /* Qt: 16 x 16 dword transposes of the rows' query pairs */
        uint32_t *qt = w->qt + g * hp * FA_LANES;
        for (int64_t dp0 = 0; dp0 < hp; dp0 += 16) {
            const int64_t n = hp - dp0 < 16 ? hp - dp0 : 16;
            const __mmask16 lm = (__mmask16)((1u << n) - 1);
            __m512 r[16];
            for (int ln = 0; ln < 16; ln++)
                r[ln] = src[ln] ? _mm512_maskz_loadu_ps(lm, src[ln] + dp0) : _mm512_setzero_ps();
            fa_tr16(r);
            for (int64_t i = 0; i < n; i++)
                _mm512_store_ps((float *)qt + (dp0 + i) * FA_LANES, r[i]);
        }
    }
    int64_t jlo, jhi;
    att_item_keys(it, qsl, seq_lens, window, &jlo, &jhi);
    for (int64_t j0 = jlo & ~(int64_t)15; j0 <= jhi; j0 += FA_CHUNK) {
        const uint16_t *kb[2];
        fa_pf pf;
        const int nsub =
            fa_chunk(w, it, bt, max_blocks, c, nkv, hd, bs, j0, jlo, jhi, kb, &pf,
                     j0 + 16 <= jhi ? 16 : 8, st);
        const int nk = 16 * nsub;
        int gs[ng], n = 0;
        for (int64_t g = 0; g < ng; g++)
            if (j0 <= ghi[g] && j0 + nk - 1 >= glo[g]) gs[n++] = (int)g;
        const uint32_t *kp32[2] = {(const uint32_t *)kb[0], (const uint32_t *)kb[nsub - 1]};
        fa_scores(w->qt, kp32, nk, gs, n, hp, w->s);
        for (int i = 0; i < n; i++) {
            const int64_t g = gs[i];
            int rescale;
            const __mmask16 active = fa_softmax(
                w->s + g * FA_CHUNK * FA_LANES, w->p, w->alpha, w->m + g * FA_LANES,
                w->l + g * FA_LANES, w->lo + g * FA_LANES, w->hi + g * FA_LANES, j0, nk, scale,
                &rescale);
            const int live = (int)(rows - g * FA_LANES < FA_LANES ? rows - g * FA_LANES : FA_LANES);
            fa_pv(w->o + g * FA_LANES * hd, w->alpha, rescale, w->p, FA_LANES, 1, w->vp, nk / 2,
                  hd, live, active);
        }
    }
    if (it->nparts > 1 && !att_part_finish(it, rows, hd, w->o, hd, w->m, w->l)) return;
    for (int64_t r = 0; r < rows; r++)
        fa_row_out(w->o + r * hd, w->l[r], (uint16_t *)out + fa_row_at(it, t0, G, r, os, hd), hd,
                   c->rot);
}

/* a0..a3: 16 partial sums of keys 0..3 -> lane 4L + k: key k's partial sum over
 * 128-bit lane L. */
static ALWAYS_INLINE TGT __m512 fa_red4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512d t0 = _mm512_castps_pd(
        _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1)));
    const __m512d t1 = _mm512_castps_pd(
        _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3)));
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(t0, t1)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t1)));
}

/* u[g] = fa_red4 of keys 4g..4g+3 -> [16] full sums, key order. */
static ALWAYS_INLINE TGT __m512 fa_red16(const __m512 *u) {
    const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44),
                                     _mm512_shuffle_f32x4(u[0], u[1], 0xee));
    const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44),
                                     _mm512_shuffle_f32x4(u[2], u[3], 0xee));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88),
                         _mm512_shuffle_f32x4(x01, x23, 0xdd));
}

/* s[r] = scores (unscaled) of 16 keys (k: [16][hd] bf16) for R query rows
 * (qr[r]: [hd] bf16): dot products with d in lanes, then a 16 -> 1 reduction.  Prefetches
 * 8 steps of pf (none when pf is NULL). */
static ALWAYS_INLINE TGT void fa_scores_rows(const uint16_t *const *qr, const uint16_t *k,
                                             int64_t hd, int R, __m512 *s, fa_pf *pf) {
    __m512 u[4][4];
    for (int kg = 0; kg < 4; kg++) {
        if (pf) {
            fa_pf_step(pf);
            fa_pf_step(pf);
        }
        __m512 acc[4][4];
        for (int r = 0; r < R; r++)
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
        for (int64_t d = 0; d < hd; d += 32) {
            const __mmask32 m = hd - d >= 32 ? ~(__mmask32)0 : ((__mmask32)1 << (hd - d)) - 1;
            __m512bh qv[4];
            for (int r = 0; r < R; r++) qv[r] = (__m512bh)_mm512_maskz_loadu_epi16(m, qr[r] + d);
            for (int j = 0; j < 4; j++) {
                const __m512bh kv =
                    (__m512bh)_mm512_maskz_loadu_epi16(m, k + (kg * 4 + j) * hd + d);
                for (int r = 0; r < R; r++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], kv, qv[r]);
            }
        }
        for (int r = 0; r < R; r++) u[r][kg] = fa_red4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
    }
    for (int r = 0; r < R; r++) s[r] = fa_red16(u[r]);
}

/* The keys of a 32-key chunk at j0 (nk keys) that a row attending keys [lo, hi] attends, as
 * masks of keys 0..15 (*m0) and 16..31 (*m1); 0 when it attends none. */
static ALWAYS_INLINE int fa_row_keys(int64_t lo, int64_t hi, int64_t j0, int nk, __mmask16 *m0,
                                     __mmask16 *m1) {
    const int64_t a = (lo > j0 ? lo : j0) - j0;
    const int64_t b = (hi < j0 + nk - 1 ? hi : j0 + nk - 1) - j0;
    if (a > b) return 0;
    const uint32_t bits = (b == 31 ? ~0u : (1u << (b + 1)) - 1) & ~((1u << a) - 1);
    *m0 = (__mmask16)bits;
    *m1 = (__mmask16)(bits >> 16);
    return 1;
}

/* One row's online-softmax step over a 32-key chunk: scaled scores x0, x1 of keys 0..15 and
 * 16..31, attended where m0, m1 are set.  Updates the row's running max *m and sum *l, sets
 * *p0, *p1 = exp(x - new max) (0 off the masks), returns the factor its output rescales by. */
static ALWAYS_INLINE TGT float fa_row_softmax(vf x0, vf x1, __mmask16 m0, __mmask16 m1,
                                              float *m, float *l, vf *p0, vf *p1) {
    const vf ninf = _mm512_set1_ps(-INFINITY);
    const float mx = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_mask_blend_ps(m0, ninf, x0), _mm512_mask_blend_ps(m1, ninf, x1)));
    const float m_new = mx > *m ? mx : *m;
    const float alpha = *m == -INFINITY ? 0.0f : expf(*m - m_new);
    const vf vm = _mm512_set1_ps(m_new);
    *p0 = _mm512_maskz_mov_ps(m0, vf_exp(_mm512_sub_ps(x0, vm)));
    *p1 = _mm512_maskz_mov_ps(m1, vf_exp(_mm512_sub_ps(x1, vm)));
    *l = *l * alpha + _mm512_reduce_add_ps(_mm512_add_ps(*p0, *p1));
    *m = m_new;
    return alpha;
}

/* The R rows of a decode item (row r: query r / G from token t0, head kvh * G + r % G): their
 * query rows qr, the keys [lo, hi] each attends, and each one's online-softmax state (m, l),
 * which starts from the sink, a key of value 0, where there is one. */
typedef struct fa_few_rows {
    int64_t G, t0;
    const uint16_t *qr[FA_LANES];
    int64_t lo[FA_LANES], hi[FA_LANES];
    float m[FA_LANES], l[FA_LANES];
} fa_few_rows;

/* fr: the R rows of item it (arguments as fa_item_run_few). */
static ALWAYS_INLINE void fa_few_rows_init(fa_few_rows *fr, const att_item *it, const void *q,
                                           int64_t qs, const int32_t *qsl,
                                           const int32_t *seq_lens, int64_t nh, int64_t nkv,
                                           int64_t hd, int64_t window, const float *sinks, int R) {
    const int64_t G = nh / nkv, t0 = qsl[it->s] + it->q0;
    const int64_t q_len = qsl[it->s + 1] - qsl[it->s], ctx = seq_lens[it->s];
    fr->G = G;
    fr->t0 = t0;
    for (int r = 0; r < R; r++) {
        att_row_keys(it, ctx - q_len + it->q0 + r / G, window, fr->lo + r, fr->hi + r);
        fr->qr[r] = (const uint16_t *)q + fa_row_at(it, t0, G, r, qs, hd);
        fr->m[r] = sinks && it->part == 0 ? sinks[it->kvh * G + r % G] : -INFINITY;
        fr->l[r] = sinks && it->part == 0 ? 1.0f : 0.0f;
    }
}

/* Row r's output in out (tokens os apart): [hd] bf16. */
static ALWAYS_INLINE uint16_t *fa_few_out(const fa_few_rows *fr, const att_item *it, void *out,
                                          int64_t os, int64_t hd, int r) {
    return (uint16_t *)out + fa_row_at(it, fr->t0, fr->G, r, os, hd);
}

/* The R rows of a decode item done (row r's unnormalised output at o + r * ostride, in key
 * order): written to out, or left as its part of a split, which the last part merges and
 * writes. */
static ALWAYS_INLINE TGT void fa_few_done(fa_few_rows *fr, const att_item *it, float *o,
                                          int64_t ostride, void *out, int64_t os, int64_t hd,
                                          int R, int rot) {
    if (it->nparts > 1 && !att_part_finish(it, R, hd, o, ostride, fr->m, fr->l)) return;
    for (int r = 0; r < R; r++)
        fa_row_out(o + r * ostride, fr->l[r], fa_few_out(fr, it, out, os, hd, r), hd, rot);
}

/* Work items of R < FA_MIN_ROWS rows (decode: one query x G heads): scores per
 * row with keys in lanes (no idle lanes), softmax per row, the same value
 * product as the row-group path.  Arguments as fa_item_run. */
static TGT void fa_item_run_few(fa_ws *w, const att_item *it, const void *q, int64_t qs,
                                const fa_cache *c, const int32_t *qsl, const int32_t *seq_lens,
                                const int32_t *bt, int64_t max_blocks, void *out, int64_t os,
                                int64_t nh, int64_t nkv, int64_t hd, int64_t bs, float scale,
                                int64_t window, const float *sinks, int R, const fa_stream *st) {
    if (c->kvt == CPUD_KV_INT8 && fa_i8_usable()) {
        fa_item_run_few_i8(w, it, q, qs, c, qsl, seq_lens, bt, max_blocks, out, os, nh, nkv, hd,
                           bs, scale, window, sinks, R, st);
        return;
    }
    if (c->kvt == CPUD_KV_FP8_E4M3) {
        fa_item_run_few_e4m3(w, it, q, qs, c, qsl, seq_lens, bt, max_blocks, out, os, nh, nkv,
                             hd, bs, scale, window, sinks, R, st);
        return;
    }
    fa_few_rows fr;
    fa_few_rows_init(&fr, it, q, qs, qsl, seq_lens, nh, nkv, hd, window, sinks, R);
    memset(w->o, 0, sizeof(float) * (size_t)(R * hd));
    int64_t jlo, jhi;
    att_item_keys(it, qsl, seq_lens, window, &jlo, &jhi);
    const vf vscale = _mm512_set1_ps(scale);
    for (int64_t j0 = jlo & ~(int64_t)15; j0 <= jhi; j0 += FA_CHUNK) {
        const uint16_t *kb[2];
        fa_pf pf;
        const int nsub =
            fa_chunk(w, it, bt, max_blocks, c, nkv, hd, bs, j0, jlo, jhi, kb, &pf,
                     j0 + 16 <= jhi ? 32 : 16, st);
        const int nk = 16 * nsub;
        __m512 s0[FA_LANES], s1[FA_LANES];
        for (int r = 0; r < R; r++) s1[r] = _mm512_setzero_ps();
        for (int rb = 0; rb < R; rb += 4) { /* 4 rows x 4 keys of accumulators at a time */
            const int rc = R - rb < 4 ? R - rb : 4;
            /* the value re-layout took nk / 2 of the chunk's nk prefetch steps; the first row
             * block takes the rest */
            fa_pf *pp = rb ? NULL : &pf;
#define FA_SR(RC)                                       \
    fa_scores_rows(fr.qr + rb, kb[0], hd, RC, s0 + rb, pp); \
    if (nsub == 2) fa_scores_rows(fr.qr + rb, kb[1], hd, RC, s1 + rb, pp);
            FA_FOR_1TO4(rc, FA_SR);
#undef FA_SR
        }
        int rescale = 0;
        __mmask16 active = 0;
        for (int r = 0; r < R; r++) {
            uint32_t *pr = w->p + r * FA_LANES;
            __mmask16 m0, m1;
            w->alpha[r] = 1.0f;
            if (!fa_row_keys(fr.lo[r], fr.hi[r], j0, nk, &m0, &m1)) {
                _mm512_store_si512(pr, _mm512_setzero_si512());
                continue;
            }
            active |= (__mmask16)(1u << r);
            const vf x0 = _mm512_mul_ps(s0[r], vscale), x1 = _mm512_mul_ps(s1[r], vscale);
            vf p0, p1;
            const float alpha = fa_row_softmax(x0, x1, m0, m1, fr.m + r, fr.l + r, &p0, &p1);
            w->alpha[r] = alpha;
            rescale |= alpha != 1.0f;
            _mm512_store_si512(pr, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
        }
        fa_pv(w->o, w->alpha, rescale, w->p, 1, FA_LANES, w->vp, nk / 2, hd, R, active);
    }
    fa_few_done(&fr, it, w->o, hd, out, os, hd, R, c->rot);
}

#include "tier_flash_int8.h"
#include "tier_flash_e4m3.h"
