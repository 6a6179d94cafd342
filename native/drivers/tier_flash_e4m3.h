/* Decode items (fewer than FA_MIN_ROWS rows) on an e4m3 KV cache for the AVX512-BF16 tier:
 * the cache bytes converted to bf16 in registers, exactly, and multiplied by vdpbf16ps.
 * Included at the end of tier_flash_bf16.h after tier_flash_int8.h, whose slot order and
 * masks it shares; fa_item_run_few enters it for e4m3 caches.
 *
 *   bytes:   b << 8 in 16-bit lanes (unpacks with zero) -> bf16 bits of e4m3 * 2^-8: the sign
 *            kept, exponent and mantissa shifted into place and the exponent rebiased by
 *            127 - 15 (an or: 112's low 4 bits are 0); exponent 0 (zero, subnormals) from a
 *            table (fa_e4_bf16).  Readers fold 256 into the row scale (kv_read_scale).
 *   scores:  s = kd * sum_d q[d] e4m3[d], the queries' bf16 pairs laid in the unpack order of
 *            the key bytes once per item (fa_e4_queries); one multiply by the scale per key.
 *   values:  the row scales vd folded into the probabilities, p' = p * vd rounded to bf16;
 *            o += sum_j p'[j] e4m3_j by vdpbf16ps on key pairs, the two rows' bytes
 *            interleaved before the widening, so o is in tier_flash_int8.h's slot order.
 * The cache is read once, as bytes (half of bf16), with no per-element conversion through f32;
 * every byte converts to a finite value, and rows outside the item's key range get p' = 0 (and
 * masked scores), which keeps whatever bytes they hold out of the sums.  A key row's score is
 * exact products summed in f32, as are the values' (unrounded e4m3 times bf16 p'), so the
 * only rounding beyond the bf16 path's is p' to bf16 where the bf16 path rounds p and the
 * dequantized value. */

/* The workspace holds qp ([16][hdp] bf16 in fa_ws.qt) and o ([16][hdp] f32 in fa_ws.o) for
 * every hd % 16 == 0 when it has ATT_ROWS / 16 >= 4 row groups (hd 16: hdp 64). */
_Static_assert(ATT_ROWS >= 64, "fa_item_run_few_e4m3's workspace");

/* b << 8 in each 16-bit lane of w (32 e4m3 bytes) -> the bf16 bits of e4m3(b) * 2^-8 where
 * b's exponent is not 0 (fa_e4_tiny fixes the others). */
static ALWAYS_INLINE TGT __m512i fa_e4_bf16(__m512i w) {
    /* (w >> 4) arithmetic: sign in 15..11, exponent and mantissa in 10..4; keep 15 and 10..4,
     * or in 112 << 7 */
    return _mm512_ternarylogic_epi32(_mm512_srai_epi16(w, 4), _mm512_set1_epi16((short)0x87f0),
                                     _mm512_set1_epi16(112 << 7), 0xea);
}

/* fa_e4_bf16(w) -> the same with the lanes whose exponent is 0 (zero, subnormals) right:
 * m * 2^-17 from a table by b's low 5 bits (its exponent bits are 0 there), the sign kept. */
static ALWAYS_INLINE TGT __m512i fa_e4_tiny(__m512i n, __m512i w) {
    const __m512i sub = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                         0, 0, 0, 0, 0, 0x3860, 0x3840, 0x3820, 0x3800, 0x37c0,
                                         0x3780, 0x3700, 0);
    const __mmask32 tiny = _mm512_testn_epi16_mask(w, _mm512_set1_epi16(0x7800));
    const __m512i t = _mm512_mask_permutexvar_epi16(n, tiny, _mm512_srli_epi16(w, 8), sub);
    return _mm512_ternarylogic_epi32(t, w, _mm512_set1_epi16((short)0x8000), 0xd8);
}

/* Whether any of the 64 bytes b has exponent 0 (then fa_e4_tiny applies). */
static ALWAYS_INLINE TGT int fa_e4_any_tiny(__m512i b) {
    return _mm512_testn_epi8_mask(b, _mm512_set1_epi8(0x78)) != 0;
}

/* Values [d, d + 32) of a row of hd bf16 (a mask for what lies inside it). */
static ALWAYS_INLINE __mmask32 fa_e4_mask32(int64_t d, int64_t hd) {
    return d >= hd ? 0 : hd - d >= 32 ? ~(__mmask32)0 : ((__mmask32)1 << (hd - d)) - 1;
}

/* qp: [R][hdp] bf16 query rows qr, zero past hd, laid as the key bytes unpack: within each
 * 64 values, the low unpack (words 0..31) holds d = 16 L + e and the high one (words 32..63)
 * d = 16 L + 8 + e, word 8 L + e of each (128-bit lane L, e < 8). */
static ALWAYS_INLINE TGT void fa_e4_queries(const uint16_t *const *qr, int R, int64_t hd,
                                            int64_t hdp, uint16_t *qp) {
    /* word 8 L + e of the low (high) half <- d = 16 L + e (16 L + 8 + e) of 64 */
    const __m512i lo = _mm512_set_epi16(55, 54, 53, 52, 51, 50, 49, 48, 39, 38, 37, 36, 35, 34,
                                        33, 32, 23, 22, 21, 20, 19, 18, 17, 16, 7, 6, 5, 4, 3, 2,
                                        1, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(8));
    for (int r = 0; r < R; r++)
        for (int64_t d = 0; d < hdp; d += 64) {
            const __m512i a = _mm512_maskz_loadu_epi16(fa_e4_mask32(d, hd), qr[r] + d);
            const __m512i b = _mm512_maskz_loadu_epi16(fa_e4_mask32(d + 32, hd), qr[r] + d + 32);
            _mm512_storeu_si512(qp + r * hdp + d, _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512(qp + r * hdp + d + 32, _mm512_permutex2var_epi16(a, hi, b));
        }
}

/* s[r] = sum_d q[d] e4m3[d] * 2^-8 of 16 keys (row j at kr + j * rb) in lanes, for RC <= 4
 * query rows (qp: [RC][hdp]); one step of pf per 4 keys. */
static ALWAYS_INLINE TGT void fa_e4_scores(const uint16_t *qp, int64_t hdp, const char *kr,
                                           int64_t rb, int64_t hd, int RC, __m512 *s,
                                           fa_pf *pf) {
    const __m512i z = _mm512_setzero_si512();
    __m512 u[4][4];
    for (int kg = 0; kg < 4; kg++) {
        if (pf) fa_pf_step(pf);
        __m512 acc[4][4];
        for (int r = 0; r < RC; r++)
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
        for (int64_t d = 0; d < hd; d += 64) {
            const __mmask64 m = fa_i8_mask(d, hd);
            __m512bh ql[4], qh[4];
            for (int r = 0; r < RC; r++) {
                ql[r] = (__m512bh)_mm512_loadu_si512(qp + r * hdp + d);
                qh[r] = (__m512bh)_mm512_loadu_si512(qp + r * hdp + d + 32);
            }
            for (int j = 0; j < 4; j++) {
                const __m512i k = _mm512_maskz_loadu_epi8(m, kr + (4 * kg + j) * rb + d);
                const __m512i wl = _mm512_unpacklo_epi8(z, k), wh = _mm512_unpackhi_epi8(z, k);
                __m512i kl = fa_e4_bf16(wl), kh = fa_e4_bf16(wh);
                if (fa_e4_any_tiny(k)) {
                    kl = fa_e4_tiny(kl, wl);
                    kh = fa_e4_tiny(kh, wh);
                }
                for (int r = 0; r < RC; r++)
                    acc[r][j] = _mm512_dpbf16_ps(
                        _mm512_dpbf16_ps(acc[r][j], (__m512bh)kl, ql[r]), (__m512bh)kh, qh[r]);
            }
        }
        for (int r = 0; r < RC; r++) u[r][kg] = fa_red4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
    }
    for (int r = 0; r < RC; r++) s[r] = fa_red16(u[r]);
}

/* o[r] (slot order, rows hdp apart) = o[r] * alpha[r] + sum_j p'[r][j] e4m3_j * 2^-8 for
 * RC rows over keys [0, nk) (vr[u]: row 0 of sub-chunk u, rows rb apart); pp: [RC][16] bf16
 * pairs of keys (2 kp, 2 kp + 1).  Each pass over the keys takes NG of the 4 vectors of 16
 * values that 64 bytes of two rows widen to (RC * NG <= 16 accumulators), so every byte is
 * converted once however many rows there are. */
static ALWAYS_INLINE TGT void fa_e4_pv(float *o, int64_t hdp, const float *alpha,
                                       const uint32_t *pp, int RC, int NG,
                                       const char *const *vr, int64_t rb, int nk, int64_t hd) {
    const __m512i z = _mm512_setzero_si512();
    for (int64_t d0 = 0; d0 < hd; d0 += 64) {
        const __mmask64 m = fa_i8_mask(d0, hd);
        for (int g0 = 0; g0 < 4; g0 += NG) {
            __m512 acc[16][4];
            for (int r = 0; r < RC; r++)
                for (int g = 0; g < NG; g++) acc[r][g] = _mm512_setzero_ps();
            for (int kp = 0; kp < nk / 2; kp++) {
                const char *row = vr[kp / 8] + (2 * kp % 16) * rb + d0;
                const __m512i a = _mm512_maskz_loadu_epi8(m, row);
                const __m512i b = _mm512_maskz_loadu_epi8(m, row + rb);
                /* byte pairs (a[d], b[d]) for d = 16 L + 0..7 (t0), 16 L + 8..15 (t1); vector g
                 * of their widening holds d = 16 L + 4 g + e in lane L, dword e */
                const __m512i t0 = _mm512_unpacklo_epi8(a, b), t1 = _mm512_unpackhi_epi8(a, b);
                __m512i wv[4];
                __m512bh v[4];
                for (int g = g0; g < g0 + NG; g++) {
                    const __m512i t = g < 2 ? t0 : t1;
                    wv[g - g0] = g & 1 ? _mm512_unpackhi_epi8(z, t) : _mm512_unpacklo_epi8(z, t);
                }
                if (fa_e4_any_tiny(a) | fa_e4_any_tiny(b)) {
                    for (int g = 0; g < NG; g++)
                        v[g] = (__m512bh)fa_e4_tiny(fa_e4_bf16(wv[g]), wv[g]);
                } else {
                    for (int g = 0; g < NG; g++) v[g] = (__m512bh)fa_e4_bf16(wv[g]);
                }
                for (int r = 0; r < RC; r++) {
                    const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pp[r * FA_LANES + kp]);
                    for (int g = 0; g < NG; g++)
                        acc[r][g] = _mm512_dpbf16_ps(acc[r][g], v[g], pb);
                }
            }
            for (int r = 0; r < RC; r++) {
                const vf al = _mm512_set1_ps(alpha[r]);
                for (int g = 0; g < NG; g++) {
                    float *dst = o + r * hdp + d0 + 16 * (g0 + g);
                    _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_loadu_ps(dst), al, acc[r][g]));
                }
            }
        }
    }
}

/* fa_item_run_few on an e4m3 cache (arguments as there). */
static TGT void fa_item_run_few_e4m3(fa_ws *w, const att_item *it, const void *q, int64_t qs,
                                     const fa_cache *c, const int32_t *qsl,
                                     const int32_t *seq_lens, const int32_t *bt,
                                     int64_t max_blocks, void *out, int64_t os, int64_t nh,
                                     int64_t nkv, int64_t hd, int64_t bs, float scale,
                                     int64_t window, const float *sinks, int R,
                                     const fa_stream *st) {
    const int64_t hdp = (hd + 63) & ~(int64_t)63, rb = c->rb;
    float alpha[FA_LANES];
    uint16_t *qp = (uint16_t *)w->qt; /* [R][hdp] */
    uint32_t *pp = w->p;              /* [R][16] */
    float *o = w->o;                  /* [R][hdp], slot order */
    fa_few_rows fr;
    fa_few_rows_init(&fr, it, q, qs, qsl, seq_lens, nh, nkv, hd, window, sinks, R);
    /* the value product runs 9..16 rows as 16: the rows past R keep p' = 0 and alpha = 1 */
    const int rows = R <= 8 ? R : FA_LANES;
    memset(o, 0, sizeof(float) * (size_t)(rows * hdp));
    for (int r = 0; r < rows; r++) alpha[r] = 1.0f;
    memset(pp, 0, sizeof(uint32_t) * FA_LANES * (size_t)rows);
    fa_e4_queries(fr.qr, R, hd, hdp, qp);
    /* the row scales * 256 (kv_read_scale), keys' times the score scale */
    const vf kmul = _mm512_set1_ps(256.0f * scale), vmul = _mm512_set1_ps(256.0f);
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
            fa_pf *pq = r0 ? NULL : &pf;
#define FA_E4_S(RC)                                                                            \
    fa_e4_scores(qp + r0 * hdp, hdp, kr[0], rb, hd, RC, s0 + r0, pq);                          \
    if (nsub == 2) fa_e4_scores(qp + r0 * hdp, hdp, kr[1], rb, hd, RC, s1 + r0, pq);
            FA_FOR_1TO4(rc, FA_E4_S);
#undef FA_E4_S
        }
        const vf ks0 = _mm512_mul_ps(fa_kv_scales(kr[0], rb, hd), kmul);
        const vf vs0 = _mm512_mul_ps(fa_kv_scales(vr[0], rb, hd), vmul);
        const vf ks1 =
            nsub == 2 ? _mm512_mul_ps(fa_kv_scales(kr[1], rb, hd), kmul) : _mm512_setzero_ps();
        const vf vs1 =
            nsub == 2 ? _mm512_mul_ps(fa_kv_scales(vr[1], rb, hd), vmul) : _mm512_setzero_ps();
        int any = 0;
        for (int r = 0; r < R; r++) {
            __mmask16 m0, m1;
            alpha[r] = 1.0f;
            _mm512_store_si512(pp + r * FA_LANES, _mm512_setzero_si512());
            if (!fa_row_keys(fr.lo[r], fr.hi[r], j0, nk, &m0, &m1)) continue;
            any = 1;
            vf p0, p1;
            alpha[r] = fa_row_softmax(_mm512_mul_ps(s0[r], ks0), _mm512_mul_ps(s1[r], ks1), m0,
                                      m1, fr.m + r, fr.l + r, &p0, &p1);
            /* p' = p * vd on the attended keys only (other rows' scales may be NaN bytes) */
            const vf w0 = _mm512_maskz_mul_ps(m0, p0, vs0), w1 = _mm512_maskz_mul_ps(m1, p1, vs1);
            _mm512_store_si512(pp + r * FA_LANES, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
        }
        if (!any) continue;
#define FA_E4_PV(RC, NG) fa_e4_pv(o, hdp, alpha, pp, RC, NG, vr, rb, nk, hd)
        switch (R) { /* rows 9..16: 16, the rows past R with p' = 0 */
        case 1: FA_E4_PV(1, 4); break;
        case 2: FA_E4_PV(2, 4); break;
        case 3: FA_E4_PV(3, 4); break;
        case 4: FA_E4_PV(4, 4); break;
        case 5: FA_E4_PV(5, 2); break;
        case 6: FA_E4_PV(6, 2); break;
        case 7: FA_E4_PV(7, 2); break;
        case 8: FA_E4_PV(8, 2); break;
        default: FA_E4_PV(16, 1);
        }
#undef FA_E4_PV
    }
    fa_slot_rows_done(&fr, it, o, hdp, out, os, hd, R, c->rot);
}
