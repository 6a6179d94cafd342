/* Int8 primitives of the quantized GEMM, scalar reference (baseline x86-64): the same 16-row
 * operands as plain arrays. */
#ifndef CPUD_QUANT_SIMD_H
#define CPUD_QUANT_SIMD_H

#include "quant.h"

#define QTGT
#define QMR 4
#define Q8_OFF 128
#define QP 1

typedef struct { uint8_t b[64]; } qv; /* [16 rows][4] u8 */
typedef struct { int32_t v[QR]; } iv;
typedef struct { float v[QR]; } fv;

static inline qv qv_ld(const uint8_t *p) {
    qv r;
    memcpy(r.b, p, sizeof r.b);
    return r;
}
/* (v >> s) & m per byte */
static inline qv qv_sm(qv v, int s, uint8_t m) {
    for (int i = 0; i < 64; i++) v.b[i] = (uint8_t)((v.b[i] >> s) & m);
    return v;
}
static inline qv qv_lo(qv v) { return qv_sm(v, 0, 0x0f); }
static inline qv qv_hi(qv v) { return qv_sm(v, 4, 0x0f); }
static inline qv qv_hi16(qv v) { return qv_hi(v); }
static inline qv qv_or(qv x, qv y) {
    for (int i = 0; i < 64; i++) x.b[i] |= y.b[i];
    return x;
}
/* ((h >> t) & 1) << 4 per byte */
static inline qv qv_b4(qv h, int t) {
    for (int i = 0; i < 64; i++) h.b[i] = (uint8_t)(((h.b[i] >> t) & 1) << 4);
    return h;
}
/* ((h >> 2t) & 3) << 4 per byte */
static inline qv qv_b6(qv h, int t) {
    for (int i = 0; i < 64; i++) h.b[i] = (uint8_t)(((h.b[i] >> (2 * t)) & 3) << 4);
    return h;
}

/* E2M1 codes (0..15 per byte) -> their doubled values + E2M1_OFF */
static inline qv qv_e2m1(qv v) {
    static const uint8_t lut[16] = {E2M1_PLUS_OFF};
    for (int i = 0; i < 64; i++) v.b[i] = lut[v.b[i] & 15];
    return v;
}

static inline iv iv_zero(void) { return (iv){{0}}; }
static inline iv iv_add(iv a, iv b) {
    for (int r = 0; r < QR; r++) a.v[r] += b.v[r];
    return a;
}
static inline iv iv_join_hi(iv lo, iv hi) { return iv_add(lo, hi); }
static inline iv iv_subs(iv a, int32_t s) {
    for (int r = 0; r < QR; r++) a.v[r] -= s;
    return a;
}
/* acc + per row sum over i of w[row][i] * x4[i]; x4: [4] i8 */
static inline iv iv_dot(iv acc, qv w, const int8_t *x4) {
    for (int r = 0; r < QR; r++)
        for (int i = 0; i < 4; i++) acc.v[r] += (int32_t)w.b[4 * r + i] * x4[i];
    return acc;
}
static inline iv iv_dot8(iv acc, qv w, const int8_t *x4) { return iv_dot(acc, w, x4); }

static inline fv fv_zero(void) { return (fv){{0}}; }
static inline fv fv_set1(float s) {
    fv r;
    for (int i = 0; i < QR; i++) r.v[i] = s;
    return r;
}
static inline fv fv_cvt(iv a) {
    fv r;
    for (int i = 0; i < QR; i++) r.v[i] = (float)a.v[i];
    return r;
}
static inline fv fv_mul(fv x, fv y) {
    for (int i = 0; i < QR; i++) x.v[i] *= y.v[i];
    return x;
}
static inline fv fv_add(fv x, fv y) {
    for (int i = 0; i < QR; i++) x.v[i] += y.v[i];
    return x;
}
static inline fv fv_fma(fv x, fv y, fv z) {
    for (int i = 0; i < QR; i++) z.v[i] += x.v[i] * y.v[i];
    return z;
}
static inline fv fv_fnma(fv x, fv y, fv z) {
    for (int i = 0; i < QR; i++) z.v[i] -= x.v[i] * y.v[i];
    return z;
}
/* p: [16] fp16 */
static inline fv fv_h16(const uint16_t *p) {
    fv r;
    for (int i = 0; i < QR; i++) r.v[i] = f16_to_f32(p[i]);
    return r;
}
/* p: [16] u8 */
static inline fv fv_u8(const uint8_t *p) {
    fv r;
    for (int i = 0; i < QR; i++) r.v[i] = (float)p[i];
    return r;
}
/* p: [16] i8 */
static inline fv fv_i8(const int8_t *p) {
    fv r;
    for (int i = 0; i < QR; i++) r.v[i] = (float)p[i];
    return r;
}
/* p: [16] E8M0 bytes -> 2^(e - 128) */
static inline fv fv_e8m0(const uint8_t *p) {
    fv r;
    for (int i = 0; i < QR; i++) r.v[i] = e8m0_half(p[i]);
    return r;
}
/* p: [16] E8M0 bytes -> what fv_e8m0_times takes (here their scales themselves) */
static inline fv fv_e8m0_pre(const uint8_t *p) { return fv_e8m0(p); }
/* fv_mul(fv_e8m0(p), a) for e = fv_e8m0_pre(p) */
static inline fv fv_e8m0_times(fv e, fv a) { return fv_mul(e, a); }
/* p: [16] */
static inline void fv_st(float *p, fv a) { memcpy(p, a.v, sizeof a.v); }

/* x: [K] of dt -> q [K] i8, d [K/32], s [K/16] */
static inline void q_quant_row(const void *x, int dt, int64_t K, int8_t *q, float *d,
                               int32_t *s) {
    for (int64_t b = 0; b < K / 32; b++) {
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(ld1(x, b * 32 + i, dt)));
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b] = amax / 127.0f;
        s[2 * b] = s[2 * b + 1] = 0;
        for (int i = 0; i < 32; i++) {
            const int32_t v = (int32_t)nearbyintf(ld1(x, b * 32 + i, dt) * id);
            q[b * 32 + i] = (int8_t)v;
            s[2 * b + i / 16] += v;
        }
    }
}

/* One iv_dot chain, iters times; returns the multiply-adds done. */
static inline double q_probe(int64_t iters, float *sink) {
    iv acc = iv_zero();
    qv w;
    memset(w.b, 3, sizeof w.b);
    const int8_t x4[4] = {1, -2, 3, -4};
    for (int64_t it = 0; it < iters; it++) {
        __asm__("" : : "m"(w));
        acc = iv_dot(acc, w, x4);
    }
    *sink += (float)acc.v[0];
    return (double)iters * 64;
}

#endif
