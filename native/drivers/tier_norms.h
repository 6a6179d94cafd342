/* RMS norms of the tier-generic kernels (included by tier_kernels.h after its access helpers).
 *
 * The weight's dtype wdt picks the rounding: wdt == dt is HF LlamaRMSNorm,
 * out = dt(dt(x * inv) * w); an f32 weight on bf16 rows is the Gemma form,
 * out = dt(x * inv * w) in fp32 with one rounding (Gemma3RMSNorm, its (1 + w) folded into the
 * f32 weight at load).  For f32 rows both are the same product. */

/* x: [H] dt -> sum of squares in fp32 */
static ALWAYS_INLINE TGT float sumsq(const void *x, int64_t H, int dt) {
    vf acc0 = vf_zero(), acc1 = vf_zero();
    int64_t i = 0;
    for (; i + 2 * VW <= H; i += 2 * VW) {
        vf a = ldv(x, i, dt), b = ldv(x, i + VW, dt);
        acc0 = vf_fma(a, a, acc0);
        acc1 = vf_fma(b, b, acc1);
    }
    for (; i + VW <= H; i += VW) {
        vf a = ldv(x, i, dt);
        acc0 = vf_fma(a, a, acc0);
    }
    float s = vf_hsum(vf_add(acc0, acc1));
    for (; i < H; i++) {
        float v = ld1(x, i, dt);
        s += v * v;
    }
    return s;
}

/* x: [H] dt -> out: [H] dt = x * inv * w, w: [H] wdt; rounded to dt after x * inv only when
 * the weight has the rows' dtype (see the top of this file). */
static ALWAYS_INLINE TGT void scale_row(const void *x, void *out, const void *w, int64_t H,
                                        float inv, int dt, int wdt) {
    const int mid = wdt == dt ? dt : CPUD_F32; /* rounding of x * inv */
    const vf vinv = vf_set1(inv);
    int64_t i = 0;
    for (; i + VW <= H; i += VW)
        stv(out, i, vf_mul(rndv(vf_mul(ldv(x, i, dt), vinv), mid), ldv(w, i, wdt)), dt);
    for (; i < H; i++) st1(out, i, rnd1(ld1(x, i, dt) * inv, mid) * ld1(w, i, wdt), dt);
}

/* x: [H] -> out: [H], w: [H] */
static ALWAYS_INLINE TGT void rms_row(const void *x, void *out, const void *w, int64_t H,
                                      float eps, int dt, int wdt) {
    const float inv = 1.0f / sqrtf(sumsq(x, H, dt) / (float)H + eps);
    scale_row(x, out, w, H, inv, dt, wdt);
}

/* x: [T][n][H] (token stride xs) -> out: [T][n][H] (token stride os), w: [H] wdt (dt, or f32
 * on bf16 rows) */
static TGT void rms_norm_k(int dt, const void *x, int64_t xs, void *out, int64_t os,
                           const void *w, int wdt, int64_t T, int64_t n, int64_t H, float eps) {
    const int64_t rows = T * n;
    CPUD_PAR_FOR(cpud_par_ok(rows * H, rows), r, rows,
        const int64_t t = r / n, h = r % n;
        const void *xr = at(x, t * xs + h * H, dt);
        void *outr = at(out, t * os + h * H, dt);
        if (dt == CPUD_F32)
            rms_row(xr, outr, w, H, eps, CPUD_F32, CPUD_F32);
        else if (wdt == CPUD_F32)
            rms_row(xr, outr, w, H, eps, CPUD_BF16, CPUD_F32);
        else
            rms_row(xr, outr, w, H, eps, CPUD_BF16, CPUD_BF16);
        );
}

/* x: [H], res: [H] -> res = dt(res + x); x = rmsnorm(res) * w */
static ALWAYS_INLINE TGT void add_rms_row(void *x, void *res, const void *w, int64_t H, float eps,
                                          int dt, int wdt) {
    int64_t i = 0;
    for (; i + VW <= H; i += VW) stv(res, i, vf_add(ldv(res, i, dt), ldv(x, i, dt)), dt);
    for (; i < H; i++) st1(res, i, ld1(res, i, dt) + ld1(x, i, dt), dt);
    rms_row(res, x, w, H, eps, dt, wdt);
}

/* x: [T][H] (token stride xs), res: [T][H] (token stride rs), w: [H] wdt */
static TGT void fused_add_rms_norm_k(int dt, void *x, int64_t xs, void *res, int64_t rs,
                                     const void *w, int wdt, int64_t T, int64_t H, float eps) {
    CPUD_PAR_FOR(cpud_par_ok(T * H, T), t, T,
        void *xr = at(x, t * xs, dt), *rr = at(res, t * rs, dt);
        if (dt == CPUD_F32)
            add_rms_row(xr, rr, w, H, eps, CPUD_F32, CPUD_F32);
        else if (wdt == CPUD_F32)
            add_rms_row(xr, rr, w, H, eps, CPUD_BF16, CPUD_F32);
        else
            add_rms_row(xr, rr, w, H, eps, CPUD_BF16, CPUD_BF16);
        );
}
