/* The mixture-of-experts layer (moe.c) as the fused decoder (decoder.c) calls it. */
#ifndef CPUD_MOE_H
#define CPUD_MOE_H

#include "common.h"

/* cpud_moe_ffn (cpud_native.h) on a kernel table; x and out may be the same rows. */
int cpud_moe_ffn_ops(const cpud_ops *ops, int dtype, const void *x, void *out, int64_t T,
                     int64_t H, int64_t I, int64_t E, int64_t k, int flags,
                     const uint16_t *router, const uint16_t *gate_up, const uint16_t *down);
/* cpud_moe_layer (cpud_native.h) on a kernel table; isa picks the quantized kernels. */
int cpud_moe_layer_ops(const cpud_ops *ops, int isa, int dtype, const cpud_moe *m,
                       const void *x, void *out, int64_t T);

/* cpud_moe_layer_ops in four steps, for a caller's thread team: begin (one thread) allocates
 * the step's buffers for the T > 0 tokens into *job (CPUD_OK, else a code and no job); the
 * router: every thread of the team calls router_part once, its share of the router logits
 * (CPUD_OK or the GEMM's code), then the team's barrier; run: every thread of the team calls it
 * once, it routes, ends with a barrier and out complete; end (one thread) frees the job and
 * returns CPUD_OK or CPUD_ENOMEM. */
typedef struct cpud_moe_job cpud_moe_job;
int cpud_moe_layer_begin(const cpud_ops *ops, int isa, int dtype, const cpud_moe *m,
                         const void *x, void *out, int64_t T, cpud_moe_job **job);
int cpud_moe_layer_router_part(cpud_moe_job *job, int tid, int nth);
void cpud_moe_layer_run(cpud_moe_job *job);
int cpud_moe_layer_end(cpud_moe_job *job);

#endif
