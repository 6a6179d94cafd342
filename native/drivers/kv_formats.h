/* KV cache element formats (cpud_native.h, enum cpud_kv_dtype): the bytes of one cached row
 * (one token of one kv head) and the scalar quantize / dequantize rules that every tier and
 * the torch reference (ranks/paged_kv.py) follow bit for bit.  No target attribute here.
 *
 *   CPUD_F32, CPUD_BF16  hd values of that type (4 hd / 2 hd bytes)
 *   CPUD_KV_INT8         hd int8 values, then their f32 scale d = amax / 127 (hd + 4 bytes,
 *                        the scale unaligned when hd % 4 != 0); value = q * d
 *   CPUD_KV_FP8_E5M2     hd bytes, each the top byte of an fp16 (1 sign, 5 exponent, 2
 *                        mantissa bits), rounded to nearest even and saturated at +-57344
 *   CPUD_KV_FP8_E4M3     hd e4m3fn bytes (1 sign, 4 exponent of bias 7, 3 mantissa bits; max
 *                        448, no inf) of x / d rounded to nearest even and saturated at +-448,
 *                        then their f32 scale d = amax / 448 as int8's (hd + 4 bytes); value =
 *                        e4m3 * d.  Readers fold 256 into d (kv_read_scale): the byte b as the
 *                        fp16 ((b & 0x80) << 8) | ((b & 0x7f) << 7) is its value * 2^-8 exactly,
 *                        so e4m3 * d = fp16 * (d * 256), the same product bit for bit.
 *
 * cpud keeps the quantized types' rows in a Hadamard basis (kv_hadamard; the entry points'
 * kv_rotated): each row is rotated before it is quantized, which spreads a head's few large
 * channels over the whole row, so the per-row scale and the fp8 mantissas lose less.  Attention
 * on such a cache takes its queries rotated the same way (cpud_kv_rotate_queries: the scores
 * are unchanged up to rounding) and rotates its output back (undoing the values' rotation).
 * A head_dim with no power-of-two factor above 1 is left as it is.  e5m2 has no scale: a row
 * whose values all point one way grows by up to sqrt(b) in its largest element (16x at head_dim
 * 128), so it saturates from |x| ~ 3584 instead of 57344. */
#ifndef CPUD_KV_FORMATS_H
#define CPUD_KV_FORMATS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpud_native.h"

#define KV_E5M2_MAX 57344.0f
#define KV_E4M3_MAX 448.0f

static inline int kv_dtype_ok(int kvt) {
    return kvt == CPUD_F32 || kvt == CPUD_BF16 || kvt == CPUD_KV_INT8 ||
           kvt == CPUD_KV_FP8_E5M2 || kvt == CPUD_KV_FP8_E4M3;
}

/* A cache of kvt under activations of dt: the same type, bf16 under f32, or a quantized one. */
static inline int kv_pair_ok(int dt, int kvt) {
    return kv_dtype_ok(kvt) && (kvt == dt || kvt >= CPUD_BF16);
}

static inline int kv_quantized(int kvt) {
    return kvt == CPUD_KV_INT8 || kvt == CPUD_KV_FP8_E5M2 || kvt == CPUD_KV_FP8_E4M3;
}

/* A quantized row type with an f32 scale after its hd values. */
static inline int kv_scaled(int kvt) { return kvt == CPUD_KV_INT8 || kvt == CPUD_KV_FP8_E4M3; }

/* Bytes of one cached row of hd values. */
static inline int64_t kv_row_bytes(int kvt, int64_t hd) {
    switch (kvt) {
    case CPUD_F32: return 4 * hd;
    case CPUD_BF16: return 2 * hd;
    case CPUD_KV_INT8:
    case CPUD_KV_FP8_E4M3: return hd + 4;
    default: return hd;
    }
}

/* Row `off` of block `phys`, kv head h of a cache [nb][nkv][bs] rows of rb bytes. */
static inline const char *kv_row(const void *cache, int64_t phys, int64_t h, int64_t off,
                                 int64_t nkv, int64_t bs, int64_t rb) {
    return (const char *)cache + ((phys * nkv + h) * bs + off) * rb;
}

static inline float kv_int8_scale(const char *row, int64_t hd) {
    float d;
    memcpy(&d, row + hd, sizeof d);
    return d;
}

/* The factor a reader multiplies a row's loaded values by: int8's scale, e4m3's scale * 256
 * (the loads give e4m3 values * 2^-8; exact: d <= FLT_MAX / 448, so d * 256 is finite), 1. */
static inline float kv_read_scale(const char *row, int64_t hd, int kvt) {
    if (kvt == CPUD_KV_INT8) return kv_int8_scale(row, hd);
    if (kvt == CPUD_KV_FP8_E4M3) return kv_int8_scale(row, hd) * 256.0f;
    return 1.0f;
}

static inline uint32_t kv_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float kv_bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* torch's float -> float8_e5m2 (c10 fp8e5m2_from_fp32_value: round to nearest even), after
 * saturating at +-57344 so a cached value is never infinite; NaN stays NaN. */
static inline uint8_t kv_f32_to_e5m2(float f) {
    if (f > KV_E5M2_MAX) f = KV_E5M2_MAX;
    if (f < -KV_E5M2_MAX) f = -KV_E5M2_MAX;
    const uint32_t denorm_mask = UINT32_C(134) << 23;
    uint32_t bits = kv_f32_bits(f);
    const uint32_t sign = bits & UINT32_C(0x80000000);
    bits ^= sign;
    uint8_t r;
    if (bits > UINT32_C(0x7f800000)) {
        r = 0x7f;
    } else if (bits < (UINT32_C(113) << 23)) { /* below the smallest normal: subnormal or 0 */
        bits = kv_f32_bits(kv_bits_f32(bits) + kv_bits_f32(denorm_mask));
        r = (uint8_t)(bits - denorm_mask);
    } else {
        const uint32_t odd = (bits >> 21) & 1;
        bits += ((uint32_t)(15 - 127) << 23) + UINT32_C(0xfffff);
        bits += odd;
        r = (uint8_t)(bits >> 21);
    }
    return (uint8_t)(r | (sign >> 24));
}

/* e5m2 -> f32, exact: exponent and mantissa moved into an f32's place, times 2^112 (the
 * exponent bias difference), which also gets subnormals right; the NaN pattern (never
 * written: values saturate) reads as a large finite number. */
static inline float kv_e5m2_to_f32(uint8_t b) {
    const float mag = kv_bits_f32((uint32_t)(b & 0x7f) << 21) * 0x1p112f;
    return (b & 0x80) ? -mag : mag;
}

/* torch's float -> float8_e4m3fn (c10 fp8e4m3fn_from_fp32_value: round to nearest even) of
 * f, already in [-448, 448] and not NaN. */
static inline uint8_t kv_f32_to_e4m3(float f) {
    const uint32_t denorm_mask = UINT32_C(141) << 23;
    uint32_t bits = kv_f32_bits(f);
    const uint32_t sign = bits & UINT32_C(0x80000000);
    bits ^= sign;
    uint8_t r;
    if (bits < (UINT32_C(121) << 23)) { /* below the smallest normal 2^-6: subnormal or 0 */
        bits = kv_f32_bits(kv_bits_f32(bits) + kv_bits_f32(denorm_mask));
        r = (uint8_t)(bits - denorm_mask);
    } else {
        const uint32_t odd = (bits >> 20) & 1;
        bits += ((uint32_t)(7 - 127) << 23) + UINT32_C(0x7ffff);
        bits += odd;
        r = (uint8_t)(bits >> 20);
    }
    return (uint8_t)(r | (sign >> 24));
}

/* e4m3fn -> f32 value * 2^-8, exact (the fp16 of kv_read_scale's note, widened): exponent
 * rebiased by 127 - 15, exponent 0 (zero, subnormals) as m * 2^-17.  The NaN patterns (never
 * written: values saturate) read as 480 * 2^-8. */
static inline float kv_e4m3_to_f32_q(uint8_t b) {
    const uint32_t em = b & 0x7f;
    const float mag = em < 8 ? (float)em * 0x1p-17f
                             : kv_bits_f32((em << 20) + (UINT32_C(112) << 23));
    return (b & 0x80) ? -mag : mag;
}

/* x [hd] -> H x * 2^-s in place, H the +-1 Walsh-Hadamard matrix of order b = 2^m, the largest
 * power of two dividing hd, on each block of b values (H H = b I).  A cached row takes s =
 * floor(m / 2), a query or an attention output s = ceil(m / 2): the two scales multiply to 1 / b,
 * so a rotated query and key give the score of the plain ones, and rotating the output of
 * attention over rotated values gives the plain output.  The scales are powers of two (exact);
 * every tier and the torch reference (ranks/paged_kv.py) add in this order, so they agree bit
 * for bit. */
static inline void kv_hadamard(float *x, int64_t hd, int query) {
    const int64_t b = hd & -hd;
    int m = 0;
    for (int64_t h = 1; h < b; h <<= 1, m++)
        for (int64_t i = 0; i < hd; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                const float u = x[j], w = x[j + h];
                x[j] = u + w;
                x[j + h] = u - w;
            }
    const float s = ldexpf(1.0f, -(query ? (m + 1) / 2 : m / 2));
    if (s != 1.0f)
        for (int64_t i = 0; i < hd; i++) x[i] *= s;
}

/* Quantizes one row of hd f32 values x into dst (kv_row_bytes(kvt, hd) bytes). */
static inline void kv_quantize_row(const float *x, int64_t hd, int kvt, char *dst) {
    if (kvt == CPUD_KV_FP8_E5M2) {
        for (int64_t i = 0; i < hd; i++) ((uint8_t *)dst)[i] = kv_f32_to_e5m2(x[i]);
        return;
    }
    float amax = 0.0f;
    for (int64_t i = 0; i < hd; i++) amax = fmaxf(amax, fabsf(x[i]));
    if (kvt == CPUD_KV_FP8_E4M3) {
        const float d = amax / KV_E4M3_MAX;
        for (int64_t i = 0; i < hd; i++) {
            float q = d != 0.0f ? x[i] / d : 0.0f;
            q = q != q ? 0.0f : fminf(fmaxf(q, -KV_E4M3_MAX), KV_E4M3_MAX);
            ((uint8_t *)dst)[i] = kv_f32_to_e4m3(q);
        }
        memcpy(dst + hd, &d, sizeof d);
        return;
    }
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int64_t i = 0; i < hd; i++) {
        float q = nearbyintf(x[i] * id);
        q = q != q ? 0.0f : q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
        ((int8_t *)dst)[i] = (int8_t)q;
    }
    memcpy(dst + hd, &d, sizeof d);
}

#endif
