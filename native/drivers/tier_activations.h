/* Gated activations of the tier-generic kernels (included by tier_kernels.h): x [T][2I] holds
 * gate | up per token, out [T][I] = dt(dt(act(gate)) * up), as HF computes
 * act(gate_proj(x)) * up_proj(x) in the model dtype (act in fp32, rounded, then the product). */

/* x: gate [I], x + uo: up [I] -> out: [I] = dt(dt(silu(gate)) * up) */
static ALWAYS_INLINE TGT void silu_mul_row(const void *x, void *out, int64_t I, int64_t uo,
                                           int dt) {
    const void *up = at(x, uo, dt);
    const vf one = vf_set1(1.0f), zero = vf_zero();
    int64_t i = 0;
    for (; i + VW <= I; i += VW) {
        vf g = ldv(x, i, dt);
        vf s = vf_div(g, vf_add(one, vf_exp(vf_sub(zero, g))));
        stv(out, i, vf_mul(rndv(s, dt), ldv(up, i, dt)), dt);
    }
    for (; i < I; i++) {
        float g = ld1(x, i, dt);
        st1(out, i, rnd1(g / (1.0f + expf(-g)), dt) * ld1(up, i, dt), dt);
    }
}

/* x: [T] rows (stride xs) of gate [I] and, uo elements on, up [I] -> out: [T][I] (stride os) */
static TGT void silu_and_mul_k(int dt, const void *x, int64_t xs, void *out, int64_t os,
                               int64_t T, int64_t I, int64_t uo) {
    CPUD_PAR_FOR(cpud_par_ok(T * I, T), t, T,
        if (dt == CPUD_BF16)
            silu_mul_row(at(x, t * xs, dt), at(out, t * os, dt), I, uo, CPUD_BF16);
        else
            silu_mul_row(at(x, t * xs, dt), at(out, t * os, dt), I, uo, CPUD_F32);
        );
}

#define GELU_KAPPA 0.044715f
#define GELU_M2BETA -1.5957691216057308f /* -2 sqrt(2 / pi) */

/* x: gate [I], x + uo: up [I] -> out: [I] = dt(dt(gelu_tanh(gate)) * up), with
 * gelu_tanh(g) = g (1 + tanh(u)) / 2 = g sigmoid(2u), u = sqrt(2 / pi) (g + 0.044715 g^3) */
static ALWAYS_INLINE TGT void gelu_tanh_mul_row(const void *x, void *out, int64_t I, int64_t uo,
                                                int dt) {
    const void *up = at(x, uo, dt);
    const vf one = vf_set1(1.0f), kappa = vf_set1(GELU_KAPPA), m2beta = vf_set1(GELU_M2BETA);
    int64_t i = 0;
    for (; i + VW <= I; i += VW) {
        vf g = ldv(x, i, dt);
        vf inner = vf_fma(vf_mul(kappa, vf_mul(g, g)), g, g);
        vf s = vf_div(g, vf_add(one, vf_exp(vf_mul(inner, m2beta))));
        stv(out, i, vf_mul(rndv(s, dt), ldv(up, i, dt)), dt);
    }
    for (; i < I; i++) {
        float g = ld1(x, i, dt);
        float inner = GELU_KAPPA * (g * g) * g + g;
        st1(out, i, rnd1(g / (1.0f + expf(inner * GELU_M2BETA)), dt) * ld1(up, i, dt), dt);
    }
}

/* x: [T] rows (stride xs) of gate [I] and, uo elements on, up [I] -> out: [T][I] (stride os) */
static TGT void gelu_tanh_and_mul_k(int dt, const void *x, int64_t xs, void *out, int64_t os,
                                    int64_t T, int64_t I, int64_t uo) {
    CPUD_PAR_FOR(cpud_par_ok(T * I, T), t, T,
        if (dt == CPUD_BF16)
            gelu_tanh_mul_row(at(x, t * xs, dt), at(out, t * os, dt), I, uo, CPUD_BF16);
        else
            gelu_tanh_mul_row(at(x, t * xs, dt), at(out, t * os, dt), I, uo, CPUD_F32);
        );
}
