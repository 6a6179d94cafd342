/* Decode items (fewer than FA_MIN_ROWS rows) on an int8 KV cache for the AVX512-BF16 tier, in
 * integers (AVX512-VNNI).  Included at the end of tier_flash_bf16.h; fa_item_run_few enters it
 * for int8 caches where the CPU has VNNI (every AVX512-BF16 CPU so far).
 *
 *   scores:  each query row rounded to int8 once per item (q ~ q8 * qd, qd = amax / 127), then
 *            s = qd * kd * sum_d q8[d] k8[d] by vpdpbusd on (k8 + 128) (u8) x q8 (s8), less
 *            128 * sum_d q8[d]; kd the key row's scale.
 *   values:  the row scales vd folded into the probabilities, p' = p * vd, rounded to u8 per row
 *            and chunk (p' ~ pu * c, c = max p' / 255); o += c * sum_j pu[j] v8[j] by vpdpbusd
 *            on 4 keys at a time (values re-laid as 4-key quads of bytes).
 * The cache is read once, as int8 (half the bytes of bf16), with no per-element conversion;
 * the softmax state (m, l) and o stay f32 as in the bf16 path. Rows outside the item's key
 * range get p = 0, which keeps whatever bytes they hold out of the integer sums. */

#define FA_I8_TGT __attribute__((target("avx512vnni"))) TGT

/* Bytes [d, d + 64) of a row of hd: a load mask for what lies inside it. */
static ALWAYS_INLINE __mmask64 fa_i8_mask(int64_t d, int64_t hd) {
    return hd - d >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << (hd - d)) - 1;
}

/* x: [hd] (and up to 63 floats past it, overwritten) = o * mul in key order, o one row of the
 * workspace in slot order: within each 64 values, element 16 g + 4 L + e holds d = 16 L + 4 g +
 * e (quad vector g, 128-bit lane L, dword e of the re-laid values), so each 64 values are a
 * 4 x 4 transpose of 128-bit lanes. */
static ALWAYS_INLINE TGT void fa_slot_row_keys(const float *o, float mul, float *x, int64_t hd) {
    const vf vi = _mm512_set1_ps(mul);
    for (int64_t d0 = 0; d0 < hd; d0 += 64) {
        const vf v0 = _mm512_loadu_ps(o + d0), v1 = _mm512_loadu_ps(o + d0 + 16);
        const vf v2 = _mm512_loadu_ps(o + d0 + 32), v3 = _mm512_loadu_ps(o + d0 + 48);
        const vf t0 = _mm512_shuffle_f32x4(v0, v1, 0x44), t1 = _mm512_shuffle_f32x4(v2, v3, 0x44);
        const vf t2 = _mm512_shuffle_f32x4(v0, v1, 0xee), t3 = _mm512_shuffle_f32x4(v2, v3, 0xee);
        const vf n[4] = {_mm512_shuffle_f32x4(t0, t1, 0x88), _mm512_shuffle_f32x4(t0, t1, 0xdd),
                         _mm512_shuffle_f32x4(t2, t3, 0x88), _mm512_shuffle_f32x4(t2, t3, 0xdd)};
        for (int L = 0; L < 4; L++) _mm512_storeu_ps(x + d0 + 16 * L, _mm512_mul_ps(n[L], vi));
    }
}

/* dst: [hd] bf16 = o / l (zeros where l is 0), o one row of the workspace in slot order
 * (fa_slot_row_keys).  With rot, o / l is rotated back from the cache's basis (kv_hadamard). */
static ALWAYS_INLINE TGT void fa_slot_row_out(const float *o, float l, uint16_t *dst,
                                              int64_t hd, int rot) {
    float x[hd + 64];
    fa_slot_row_keys(o, l > 0.0f ? 1.0f / l : 0.0f, x, hd);
    if (rot) hadamard_rows_k(x, 1, hd, 1);
    for (int64_t d = 0; d < hd; d += 16) vf_st_bf16(dst + d, _mm512_loadu_ps(x + d));
}

/* fa_few_done for the R rows of o in slot order, hdp apart. */
static ALWAYS_INLINE TGT void fa_slot_rows_done(fa_few_rows *fr, const att_item *it,
                                                const float *o, int64_t hdp, void *out,
                                                int64_t os, int64_t hd, int R, int rot) {
    if (it->nparts == 1) {
        for (int r = 0; r < R; r++)
            fa_slot_row_out(o + r * hdp, fr->l[r], fa_few_out(fr, it, out, os, hd, r), hd, rot);
        return;
    }
    float x[R * hd + 64];
    for (int r = 0; r < R; r++) fa_slot_row_keys(o + r * hdp, 1.0f, x + r * hd, hd);
    fa_few_done(fr, it, x, hd, out, os, hd, R, rot);
}

/* q8 rows [R][hdp] (zero past hd) of the R query rows qr, their scales qd (times scale) and
 * 128 * their sums. */
static ALWAYS_INLINE FA_I8_TGT void fa_i8_queries(const uint16_t *const *qr, int R, int64_t hd,
                                                  int64_t hdp, float scale, int8_t *q8, float *qd,
                                                  float *off) {
    for (int r = 0; r < R; r++) {
        vf amax = _mm512_setzero_ps();
        for (int64_t d = 0; d < hd; d += 16)
            amax = _mm512_max_ps(amax, _mm512_abs_ps(vf_ld_bf16(qr[r] + d)));
        const float a = _mm512_reduce_max_ps(amax);
        const vf inv = _mm512_set1_ps(a > 0.0f ? 127.0f / a : 0.0f);
        __m512i sum = _mm512_setzero_si512();
        int8_t *dst = q8 + r * hdp;
        memset(dst, 0, (size_t)hdp);
        for (int64_t d = 0; d < hd; d += 16) {
            const __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(vf_ld_bf16(qr[r] + d), inv));
            sum = _mm512_add_epi32(sum, i);
            _mm_storeu_si128((__m128i *)(dst + d), _mm512_cvtsepi32_epi8(i));
        }
        qd[r] = a / 127.0f * scale;
        off[r] = 128.0f * (float)_mm512_reduce_add_epi32(sum);
    }
}

/* s[r] = sum_d (k8 + 128) q8 of 16 keys (row j at kr + j * rb) in lanes, for RC <= 4 query
 * rows (q8: [RC][hdp]); one step of pf per 4 keys. */
static ALWAYS_INLINE FA_I8_TGT void fa_i8_scores(const int8_t *q8, int64_t hdp, const char *kr,
                                                 int64_t rb, int64_t hd, int RC, __m512 *s,
                                                 fa_pf *pf) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 u[4][4];
    for (int kg = 0; kg < 4; kg++) {
        if (pf) fa_pf_step(pf);
        __m512i acc[4][4];
        for (int r = 0; r < RC; r++)
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_si512();
        for (int64_t d = 0; d < hd; d += 64) {
            const __mmask64 m = fa_i8_mask(d, hd);
            __m512i qv[4];
            for (int r = 0; r < RC; r++) qv[r] = _mm512_loadu_si512(q8 + r * hdp + d);
            for (int j = 0; j < 4; j++) {
                const __m512i kv = _mm512_xor_si512(
                    _mm512_maskz_loadu_epi8(m, kr + (4 * kg + j) * rb + d), flip);
                for (int r = 0; r < RC; r++) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], kv, qv[r]);
            }
        }
        for (int r = 0; r < RC; r++)
            u[r][kg] = fa_red4(_mm512_cvtepi32_ps(acc[r][0]), _mm512_cvtepi32_ps(acc[r][1]),
                               _mm512_cvtepi32_ps(acc[r][2]), _mm512_cvtepi32_ps(acc[r][3]));
    }
    for (int r = 0; r < RC; r++) s[r] = fa_red16(u[r]);
}

/* The f32 scales of 16 rows (row j at row0 + j * rb, scale after its hd bytes), in lanes. */
static ALWAYS_INLINE TGT __m512 fa_kv_scales(const char *row0, int64_t rb, int64_t hd) {
    const __m512i idx = _mm512_add_epi32(
        _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                           _mm512_set1_epi32((int)rb)),
        _mm512_set1_epi32((int)hd));
    return _mm512_i32gather_ps(idx, row0, 1);
}

/* o[r] (slot order, rows hdp apart) = o[r] * alpha[r] + c[r] * sum_j pu[r][j] v8[j] for RC <= 4
 * rows over keys [0, nk) (vr[u]: row 0 of sub-chunk u, rows rb apart); pu: [R][FA_CHUNK] u8. */
static ALWAYS_INLINE FA_I8_TGT void fa_i8_pv(float *o, int64_t hdp, const float *alpha,
                                             const float *c, const uint8_t *pu, int RC,
                                             const char *const *vr, int64_t rb, int nk,
                                             int64_t hd) {
    for (int64_t d0 = 0; d0 < hd; d0 += 64) {
        const __mmask64 m = fa_i8_mask(d0, hd);
        __m512i acc[4][4];
        for (int r = 0; r < RC; r++)
            for (int g = 0; g < 4; g++) acc[r][g] = _mm512_setzero_si512();
        for (int kq = 0; kq < nk / 4; kq++) {
            const char *row = vr[kq / 4] + (4 * kq % 16) * rb + d0;
            const __m512i r0 = _mm512_maskz_loadu_epi8(m, row);
            const __m512i r1 = _mm512_maskz_loadu_epi8(m, row + rb);
            const __m512i r2 = _mm512_maskz_loadu_epi8(m, row + 2 * rb);
            const __m512i r3 = _mm512_maskz_loadu_epi8(m, row + 3 * rb);
            const __m512i t0 = _mm512_unpacklo_epi8(r0, r1), t1 = _mm512_unpackhi_epi8(r0, r1);
            const __m512i t2 = _mm512_unpacklo_epi8(r2, r3), t3 = _mm512_unpackhi_epi8(r2, r3);
            const __m512i v[4] = {_mm512_unpacklo_epi16(t0, t2), _mm512_unpackhi_epi16(t0, t2),
                                  _mm512_unpacklo_epi16(t1, t3), _mm512_unpackhi_epi16(t1, t3)};
            for (int r = 0; r < RC; r++) {
                int32_t quad;
                memcpy(&quad, pu + r * FA_CHUNK + 4 * kq, sizeof quad);
                const __m512i pb = _mm512_set1_epi32(quad);
                for (int g = 0; g < 4; g++) acc[r][g] = _mm512_dpbusd_epi32(acc[r][g], pb, v[g]);
            }
        }
        for (int r = 0; r < RC; r++) {
            const vf al = _mm512_set1_ps(alpha[r]), cr = _mm512_set1_ps(c[r]);
            for (int g = 0; g < 4; g++) {
                float *dst = o + r * hdp + d0 + 16 * g;
                _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][g]), cr,
                                                      _mm512_mul_ps(_mm512_loadu_ps(dst), al)));
            }
        }
    }
}

/* The 32-key chunk at j0 of a decode item on a cache of byte rows (int8, e4m3; keys [jlo, jhi],
 * arguments as fa_item_run_few): kr, vr as fa_chunk_rows, pf planned over one step per 4 keys
 * of the scores.  Returns its sub-chunks of 16 keys (1 or 2). */
static ALWAYS_INLINE int fa_byte_chunk(const char **kr, const char **vr, fa_pf *pf,
                                       const att_item *it, const int32_t *bt, int64_t max_blocks,
                                       const fa_cache *c, int64_t nkv, int64_t bs, int64_t j0,
                                       int64_t jlo, int64_t jhi, const fa_stream *st) {
    const int nsub = j0 + 16 <= jhi ? 2 : 1;
    fa_chunk_rows(kr, vr, it, bt, max_blocks, c, nkv, bs, j0, nsub);
    fa_pf_plan(pf, it, bt, max_blocks, c, nkv, bs, j0, jlo, jhi, 4 * nsub, st);
    return nsub;
}

/* fa_item_run_few on an int8 cache (arguments as there). */
static FA_I8_TGT void fa_item_run_few_i8(fa_ws *w, const att_item *it, const void *q, int64_t qs,
                                         const fa_cache *c, const int32_t *qsl,
                                         const int32_t *seq_lens, const int32_t *bt,
                                         int64_t max_blocks, void *out, int64_t os, int64_t nh,
                                         int64_t nkv, int64_t hd, int64_t bs, float scale,
                                         int64_t window, const float *sinks, int R,
                                         const fa_stream *st) {
    const int64_t hdp = (hd + 63) & ~(int64_t)63, rb = c->rb;
    float qd[FA_LANES], off[FA_LANES], cq[FA_LANES];
    int8_t *q8 = (int8_t *)w->kst; /* [R][hdp] */
    uint8_t *pu = (uint8_t *)w->p; /* [R][FA_CHUNK] */
    float *o = w->o;               /* [R][hdp], slot order */
    fa_few_rows fr;
    fa_few_rows_init(&fr, it, q, qs, qsl, seq_lens, nh, nkv, hd, window, sinks, R);
    memset(o, 0, sizeof(float) * (size_t)(R * hdp));
    fa_i8_queries(fr.qr, R, hd, hdp, scale, q8, qd, off);
    int64_t jlo, jhi;
    att_item_keys(it, qsl, seq_lens, window, &jlo, &jhi);
    for (int64_t j0 = jlo & ~(int64_t)15; j0 <= jhi; j0 += FA_CHUNK) {
        const char *kr[2], *vr[2];
        fa_pf pf;
        const int nsub =
            fa_byte_chunk(kr, vr, &pf, it, bt, max_blocks, c, nkv, bs, j0, jlo, jhi, st);
        const int nk = 16 * nsub;
        __m512 s0[FA_LANES], s1[FA_LANES];
        for (int r = 0; r < R; r++) s1[r] = _mm512_setzero_ps();
        for (int r0 = 0; r0 < R; r0 += 4) {
            const int rc = R - r0 < 4 ? R - r0 : 4;
            fa_pf *pp = r0 ? NULL : &pf;
#define FA_I8_S(RC)                                                                            \
    fa_i8_scores(q8 + r0 * hdp, hdp, kr[0], rb, hd, RC, s0 + r0, pp);                          \
    if (nsub == 2) fa_i8_scores(q8 + r0 * hdp, hdp, kr[1], rb, hd, RC, s1 + r0, pp);
            FA_FOR_1TO4(rc, FA_I8_S);
#undef FA_I8_S
        }
        const vf ks0 = fa_kv_scales(kr[0], rb, hd), vs0 = fa_kv_scales(vr[0], rb, hd);
        const vf ks1 = nsub == 2 ? fa_kv_scales(kr[1], rb, hd) : _mm512_setzero_ps();
        const vf vs1 = nsub == 2 ? fa_kv_scales(vr[1], rb, hd) : _mm512_setzero_ps();
        float alpha[FA_LANES];
        int any = 0;
        for (int r = 0; r < R; r++) {
            __mmask16 m0, m1;
            alpha[r] = 1.0f;
            cq[r] = 0.0f;
            memset(pu + r * FA_CHUNK, 0, FA_CHUNK);
            if (!fa_row_keys(fr.lo[r], fr.hi[r], j0, nk, &m0, &m1)) continue;
            any = 1;
            const vf vo = _mm512_set1_ps(off[r]), vq = _mm512_set1_ps(qd[r]);
            const vf x0 = _mm512_mul_ps(_mm512_mul_ps(_mm512_sub_ps(s0[r], vo), vq), ks0);
            const vf x1 = _mm512_mul_ps(_mm512_mul_ps(_mm512_sub_ps(s1[r], vo), vq), ks1);
            vf p0, p1;
            alpha[r] = fa_row_softmax(x0, x1, m0, m1, fr.m + r, fr.l + r, &p0, &p1);
            /* p' = p * vd on the attended keys only (other rows' scales may be NaN bytes) */
            const vf w0 = _mm512_maskz_mul_ps(m0, p0, vs0), w1 = _mm512_maskz_mul_ps(m1, p1, vs1);
            const float pmax = _mm512_reduce_max_ps(_mm512_max_ps(w0, w1));
            if (!(pmax > 0.0f)) continue;
            const vf inv = _mm512_set1_ps(255.0f / pmax);
            cq[r] = pmax / 255.0f;
            _mm_storeu_si128((__m128i *)(pu + r * FA_CHUNK),
                             _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(w0, inv))));
            _mm_storeu_si128((__m128i *)(pu + r * FA_CHUNK + 16),
                             _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(w1, inv))));
        }
        if (!any) continue;
        for (int r0 = 0; r0 < R; r0 += 4) {
            const int rc = R - r0 < 4 ? R - r0 : 4;
            float *orow = o + r0 * hdp;
#define FA_I8_PV(RC)                                                                           \
    fa_i8_pv(orow, hdp, alpha + r0, cq + r0, pu + r0 * FA_CHUNK, RC, vr, rb, nk, hd);
            FA_FOR_1TO4(rc, FA_I8_PV);
#undef FA_I8_PV
        }
    }
    fa_slot_rows_done(&fr, it, o, hdp, out, os, hd, R, c->rot);
}
