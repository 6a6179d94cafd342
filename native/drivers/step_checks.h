/* Step-plan checks and the KV scatter, shared by the per-op entry points
 * (api.c) and the decoder stack (decoder.c).  Internal: not in the cffi API. */
#ifndef CPUD_STEP_CHECKS_H
#define CPUD_STEP_CHECKS_H

#include <stdint.h>

#include "common.h"
#include "kv_formats.h"

/* Every position in [0, max_pos). */
int cpud_positions_ok(const int64_t *pos, int64_t T, int64_t max_pos);
/* Every slot below capacity (negative slots are skipped by the scatter). */
int cpud_slots_ok(const int64_t *slots, int64_t T, int64_t capacity);
/* Every sequence's queries inside [0, T), contexts long enough, every block
 * that will be read inside the cache. */
int cpud_attention_plan_ok(const int32_t *qsl, const int32_t *seq_lens, const int32_t *bt,
                           int64_t max_blocks, int64_t T, int64_t S, int64_t num_blocks,
                           int64_t bs, int64_t window);
/* Heads [h0, h1) of src: [T][nkv][hd] (token stride ss) -> cache: [nb][nkv][bs][hd] at slots */
void cpud_kv_scatter(const char *src, int64_t ss, char *cache, const int64_t *slots, int64_t T,
                     int64_t nkv, int64_t h0, int64_t h1, int64_t hd, int64_t bs, int es);
/* kv_formats.h's kv_hadamard on rows [rows][hd] f32 in place (a tier's hadamard_rows). */
typedef void (*cpud_rotate_fn)(float *x, int64_t rows, int64_t hd, int query);
/* The rotation cpud's caches of kvt take (kv_formats.h): ops' hadamard_rows where kvt is a
 * quantized type, else NULL. */
static inline cpud_rotate_fn cpud_kv_rotation(const cpud_ops *ops, int kvt) {
    return kv_quantized(kvt) ? ops->hadamard_rows : NULL;
}
/* Heads [h0, h1) of src: [T][nkv][hd] of dt (token stride ss) -> cache: [nb][nkv][bs] rows of
 * kvt (kv_formats.h) at slots: a copy where kvt is dt, else each row converted or quantized
 * (rotated by rot first where rot is not NULL). */
void cpud_kv_write(const void *src, int dt, int64_t ss, void *cache, int kvt, cpud_rotate_fn rot,
                   const int64_t *slots, int64_t T, int64_t nkv, int64_t h0, int64_t h1,
                   int64_t hd, int64_t bs);
/* Heads [h0, h1) of q: [T][nh][hd] of dt (token stride qs) rotated by rot into the basis of a
 * quantized cache's rows (kv_hadamard), as attention on such a cache takes them, written to the
 * same heads of out (token stride os; out may be q). */
void cpud_kv_rotate_queries(cpud_rotate_fn rot, const void *q, int64_t qs, void *out, int64_t os,
                            int dt, int64_t T, int64_t h0, int64_t h1, int64_t hd);

#endif
