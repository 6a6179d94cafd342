/* The bf16 flash path's reads of quantized KV caches (int8, e5m2, e4m3): keys converted to bf16
 * rows 16 at a time, values straight into the key-pair layout of fa_value_pairs.  Included by
 * tier_flash_bf16.h after fa_value_pairs; every value is rounded to bf16 once (int8, e4m3: the
 * f32 product with the scale, then rounded).  Decode items on int8 caches take
 * tier_flash_int8.h instead, on e4m3 caches tier_flash_e4m3.h. */

/* Values [d, d + 16) of a quantized row (kvt, scale: its kv_read_scale) as f32, or zeros for
 * no row. */
static ALWAYS_INLINE TGT __m512 fa_qvals(const char *row, int64_t d, int kvt, float scale) {
    if (!row) return _mm512_setzero_ps();
    return kv_ldq(row, d, kvt, _mm512_set1_ps(scale));
}

/* p: [32] e5m2 bytes -> their bf16 bit patterns, exact (kv_e5m2_to_f32's values), in the
 * 16-bit lanes: exponent rebiased by 127 - 15 with the 2 mantissa bits on top; exponent 0
 * (zero and the three subnormals) from a table. */
static ALWAYS_INLINE TGT __m512i fa_e5m2_bf16x32(const uint8_t *p) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    const __m512i em = _mm512_and_si512(w, _mm512_set1_epi16(0x7f));
    const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8);
    const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(em, 5), _mm512_set1_epi16(112 << 7));
    /* m * 2^-16 for m = 0..3: 0, 2^-16, 2^-15, 1.5 * 2^-15 */
    const __m512i sub = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                         0, 0, 0, 0, 0, 0, 0, 0, 0, (112 << 7) | 0x40, 112 << 7,
                                         111 << 7, 0);
    const __mmask32 tiny = _mm512_cmplt_epu16_mask(em, _mm512_set1_epi16(4));
    return _mm512_or_si512(_mm512_mask_permutexvar_epi16(normal, tiny, em, sub), sign);
}

/* fa_value_pairs straight from quantized rows (vr[u]: row 0 of sub-chunk u, rows rb bytes
 * apart): each value rounded to bf16 as fa_dequant_rows rounds it, so the pairs are those
 * fa_value_pairs makes of its rows. */
static ALWAYS_INLINE TGT void fa_value_pairs_q(uint32_t *vp, const char *const *vr, int64_t rb,
                                               int kvt, int64_t j0, int nk, int64_t jlo,
                                               int64_t jhi, int64_t hd, fa_pf *pf) {
    /* (a[i], b[i]) bf16 pairs from cvtne2ps(b, a) = [a 0..15 | b 0..15] */
    const __m512i ilv = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
    __m512i ilv_lo, ilv_hi; /* as fa_value_pairs */
    fa_pair_perms(&ilv_lo, &ilv_hi);
    for (int kp = 0; kp < nk / 2; kp++) {
        const int64_t ja = j0 + 2 * kp, jb = ja + 1;
        const char *row = vr[kp / 8] + (2 * kp % 16) * rb;
        const char *row_a = (ja >= jlo && ja <= jhi) ? row : NULL;
        const char *row_b = (jb >= jlo && jb <= jhi) ? row + rb : NULL;
        const float da = row_a ? kv_read_scale(row_a, hd, kvt) : 1.0f;
        const float db = row_b ? kv_read_scale(row_b, hd, kvt) : 1.0f;
        uint32_t *dst = vp + kp * hd;
        fa_pf_step(pf);
        int64_t d = 0;
        for (; kvt == CPUD_KV_FP8_E5M2 && d + 32 <= hd; d += 32) {
            const __m512i z = _mm512_setzero_si512();
            const __m512i a = row_a ? fa_e5m2_bf16x32((const uint8_t *)row_a + d) : z;
            const __m512i b = row_b ? fa_e5m2_bf16x32((const uint8_t *)row_b + d) : z;
            fa_store_pairs(dst + d, a, b, ilv_lo, ilv_hi);
        }
        for (; d < hd; d += 16) {
            const __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(fa_qvals(row_b, d, kvt, db),
                                                           fa_qvals(row_a, d, kvt, da));
            _mm512_storeu_si512(dst + d, _mm512_permutexvar_epi16(ilv, ab));
        }
    }
}

/* Rows [a, b] of 16 quantized rows (row j at row0 + j * rb, of kvt) -> the same rows of dst:
 * [16][hd] bf16 (hd % 16 == 0), each value (kv_ldq's f32) rounded to bf16. */
static ALWAYS_INLINE TGT void fa_dequant_rows(uint16_t *dst, const char *row0, int64_t rb,
                                              int kvt, int64_t a, int64_t b, int64_t hd) {
    for (int64_t j = a; j <= b; j++) {
        const char *row = row0 + j * rb;
        if (kv_scaled(kvt)) {
            const vf d = _mm512_set1_ps(kv_read_scale(row, hd, kvt));
            for (int64_t i = 0; i < hd; i += 16)
                vf_st_bf16(dst + j * hd + i, kv_ldq(row, i, kvt, d));
        } else {
            int64_t i = 0;
            for (; i + 32 <= hd; i += 32)
                _mm512_storeu_si512(dst + j * hd + i, fa_e5m2_bf16x32((const uint8_t *)row + i));
            for (; i < hd; i += 16)
                vf_st_bf16(dst + j * hd + i, kv_ld_e5m2((const uint8_t *)row + i));
        }
    }
}

/* Int8 decode items in integers (tier_flash_int8.h, defined after the bf16 path it shares):
 * where the CPU has AVX512-VNNI. */
static inline int fa_i8_usable(void) { return __builtin_cpu_supports("avx512vnni"); }
static __attribute__((target("avx512vnni"))) TGT void fa_item_run_few_i8(
    fa_ws *w, const att_item *it, const void *q, int64_t qs, const fa_cache *c,
    const int32_t *qsl, const int32_t *seq_lens, const int32_t *bt, int64_t max_blocks, void *out,
    int64_t os, int64_t nh, int64_t nkv, int64_t hd, int64_t bs, float scale, int64_t window,
    const float *sinks, int R, const fa_stream *st);

/* E4m3 decode items converted to bf16 in registers (tier_flash_e4m3.h). */
static TGT void fa_item_run_few_e4m3(fa_ws *w, const att_item *it, const void *q, int64_t qs,
                                     const fa_cache *c, const int32_t *qsl,
                                     const int32_t *seq_lens, const int32_t *bt,
                                     int64_t max_blocks, void *out, int64_t os, int64_t nh,
                                     int64_t nkv, int64_t hd, int64_t bs, float scale,
                                     int64_t window, const float *sinks, int R,
                                     const fa_stream *st);
