/* cpud native kernels: public C API (also parsed by cffi, see build_native.py).
 *
 * Conventions
 * - Every tensor argument is passed as an address (intptr_t) so Python can hand
 *   over torch's data_ptr() without a cast; the shape of what it points to is
 *   written next to it, outermost dimension first.  "stride" arguments count
 *   elements (not bytes) between consecutive tokens; inner dimensions are dense.
 * - isa selects the kernel tier (CPUD_ISA_*); a tier above cpud_detect_isa()
 *   is refused with CPUD_EISA, never executed.
 * - dtype codes: CPUD_F32 or CPUD_BF16; one code describes every activation
 *   tensor of a call unless a separate code is given.
 * - Return value: 0 on success, a negative CPUD_E* code otherwise.
 * - Threading: OpenMP, using the calling thread's team size
 *   (omp_get_max_threads, i.e. what torch.set_num_threads set).
 */
#ifndef CPUD_NATIVE_H
#define CPUD_NATIVE_H

#include <stdint.h>

enum cpud_isa {
    CPUD_ISA_SCALAR = 0,
    CPUD_ISA_AVX2 = 1,
    CPUD_ISA_AVX512 = 2,
    CPUD_ISA_AVX512BF16 = 3,
    CPUD_ISA_AMX = 4 /* AVX512-BF16 kernels, GEMMs of 4+ rows on AMX-BF16 tiles */
};
enum cpud_dtype { CPUD_F32 = 0, CPUD_BF16 = 1 };
/* KV cache element types (kv_dtype arguments): CPUD_F32 / CPUD_BF16 rows of that type (bf16
 * also under f32 activations), or quantized rows: CPUD_KV_INT8 = hd int8 values then their f32
 * scale amax / 127 (hd + 4 bytes per row), CPUD_KV_FP8_E5M2 = hd bytes, each the top byte of an
 * fp16 (round to nearest even, saturated at +-57344), CPUD_KV_FP8_E4M3 = hd e4m3fn bytes of
 * value / scale then their f32 scale amax / 448 (hd + 4 bytes).  drivers/kv_formats.h has the
 * rules. */
enum cpud_kv_dtype { CPUD_KV_INT8 = 2, CPUD_KV_FP8_E5M2 = 3, CPUD_KV_FP8_E4M3 = 4 };
enum cpud_err { CPUD_OK = 0, CPUD_EISA = -1, CPUD_EARG = -2, CPUD_ENOMEM = -3 };

/* Highest tier this CPU and OS can run (cpuid + XGETBV), fixed at load. */
int cpud_detect_isa(void);
/* Threads an OpenMP parallel region started by the calling thread would get. */
int cpud_max_threads(void);

/* out = rmsnorm(x) * w, rows of H computed in fp32. x may alias out.  w_dtype picks the
 * rounding: dtype gives HF LlamaRMSNorm's dt(dt(x * inv) * w); CPUD_F32 on bf16 x gives
 * Gemma's dt(x * inv * w) in fp32, rounded once (Gemma3RMSNorm with its 1 + w folded into an
 * f32 weight).  Any other pairing is CPUD_EARG. */
int cpud_rms_norm(int isa, int dtype,
                  intptr_t x,       /* [T][n][H], token stride x_stride       */
                  int64_t x_stride,
                  intptr_t out,     /* [T][n][H], token stride out_stride     */
                  int64_t out_stride,
                  intptr_t w,       /* [H], w_dtype                            */
                  int w_dtype, int64_t T, int64_t n, int64_t H, float eps);

/* residual += x; x = rmsnorm(residual) * w, in place; w_dtype as in cpud_rms_norm. */
int cpud_fused_add_rms_norm(int isa, int dtype,
                            intptr_t x,        /* [T][H], token stride x_stride   */
                            int64_t x_stride,
                            intptr_t residual, /* [T][H], token stride r_stride   */
                            int64_t r_stride,
                            intptr_t w,        /* [H], w_dtype                    */
                            int w_dtype, int64_t T, int64_t H, float eps);

/* Rotary embedding in place on the first rot_dim dims of every head.
 * neox != 0: rotate halves; neox == 0: gpt-j interleaved pairs. */
int cpud_rotary_embedding(int isa, int dtype,
                          intptr_t positions, /* [T] int64                          */
                          intptr_t q,         /* [T][nh][hd], token stride q_stride */
                          int64_t q_stride,
                          intptr_t k,         /* [T][nkv][hd] or 0, stride k_stride */
                          int64_t k_stride,
                          intptr_t cos_sin,   /* [max_pos][rot_dim] f32: cos | sin   */
                          int64_t T, int64_t nh, int64_t nkv, int64_t hd, int64_t rot_dim,
                          int64_t max_pos, int neox);

/* out = silu(x[:, :I]) * x[:, I:] */
int cpud_silu_and_mul(int isa, int dtype,
                      intptr_t x,   /* [T][2I], token stride x_stride */
                      int64_t x_stride,
                      intptr_t out, /* [T][I], token stride out_stride */
                      int64_t out_stride, int64_t T, int64_t I);

/* out = dt(dt(gelu_tanh(x[:, :I])) * x[:, I:]): torch's gelu(approximate="tanh") in fp32 */
int cpud_gelu_tanh_and_mul(int isa, int dtype,
                           intptr_t x,   /* [T][2I], token stride x_stride */
                           int64_t x_stride,
                           intptr_t out, /* [T][I], token stride out_stride */
                           int64_t out_stride, int64_t T, int64_t I);

/* out[r] = index of the first largest of x[r][0..n) (NaN never counts; 0 when no value
 * beats -inf): greedy sampling over logits */
int cpud_argmax_rows(int isa, int dtype,
                     intptr_t x,   /* [rows][n], row stride x_stride */
                     int64_t x_stride, int64_t rows, int64_t n,
                     intptr_t out); /* [rows] int64 */

/* key_cache[b][h][o] = key[t][h] for slot = slot_mapping[t] = b*bs + o >= 0, stored as
 * kv_dtype rows (quantized per row for CPUD_KV_INT8 / CPUD_KV_FP8_E5M2 / CPUD_KV_FP8_E4M3;
 * kv_rotated nonzero: each quantized row rotated by a Walsh-Hadamard transform first,
 * kv_formats.h, as cpud's caches are). */
int cpud_write_kv_cache(int isa, int dtype, int kv_dtype,
                        intptr_t key,          /* [T][nkv][hd], token stride key_stride   */
                        intptr_t value,        /* [T][nkv][hd], token stride value_stride */
                        int64_t key_stride, int64_t value_stride,
                        intptr_t key_cache,    /* [num_blocks][nkv][bs] rows of kv_dtype */
                        intptr_t value_cache,  /* [num_blocks][nkv][bs] rows of kv_dtype */
                        intptr_t slot_mapping, /* [T] int64, < 0 = skip                 */
                        int64_t T, int64_t nkv, int64_t hd, int64_t num_blocks, int64_t bs,
                        int kv_rotated);

/* The work items cpud_paged_attention splits S sequences into (query_start_loc, seq_lens and
 * sliding_window as there, nh query and nkv kv heads of hd): one per query tile and kv head,
 * and a decode (a sequence's queries that fit one tile) one per fixed range of key positions
 * its window leaves (drivers/att_plan.h), or < 0 (cpud_err).  The split depends on these
 * arguments alone, not on the threads. */
int64_t cpud_attention_items(intptr_t query_start_loc, intptr_t seq_lens, int64_t S, int64_t nh,
                             int64_t nkv, int64_t hd, int64_t sliding_window);

/* Paged causal attention with GQA for decode and chunked prefill.
 * Query i of sequence s sits at position seq_lens[s] - q_len + i and attends
 * keys j with max(0, p - window + 1) <= j <= p (window 0 = unlimited).  sinks (or 0): a
 * logit per query head joined to the softmax's denominator only (gpt-oss):
 * p_j = exp(s_j - m) / (exp(sink - m) + sum_i exp(s_i - m)).  A quantized cache's rows are
 * read as their values (e5m2 exactly, int8 / e4m3 as code * scale); with kv_rotated those are
 * in the rows' rotated basis, the queries are rotated into it (rounded to dtype) and the
 * output rotated back. */
int cpud_paged_attention(int isa, int dtype, int kv_dtype,
                         intptr_t query,           /* [>= qsl[S]][nh][hd], stride q_stride */
                         int64_t q_stride,
                         intptr_t key_cache,       /* [num_blocks][nkv][bs] kv_dtype rows  */
                         intptr_t value_cache,     /* [num_blocks][nkv][bs] kv_dtype rows  */
                         intptr_t query_start_loc, /* [S+1] int32                          */
                         intptr_t seq_lens,        /* [S] int32                            */
                         intptr_t block_tables,    /* [S][max_blocks] int32                */
                         int64_t max_blocks,
                         intptr_t out,             /* [T][nh][hd], token stride out_stride */
                         int64_t out_stride, int64_t T, int64_t S, int64_t nh, int64_t nkv,
                         int64_t hd, int64_t num_blocks, int64_t bs, float scale,
                         int64_t sliding_window,
                         intptr_t sinks,           /* [nh] f32, or 0                       */
                         int kv_rotated); /* a quantized cache's rows are rotated (as written
                                             with kv_rotated): queries are rotated likewise and
                                             the output back, which leaves it unchanged */

/* Packed weight layout for the skinny GEMM: W[N][K] bf16 is stored as
 * [ceil(N/32)][ceil(K/2)][32][2] bf16, zero padded: for each panel of 32
 * output columns and each pair of k, the 32 columns' (k, k+1) pairs - one
 * 64-byte vdpbf16ps operand per 16 columns.  Packed shards are kept on disk
 * between starts (cpud.ranks.weight_cache): bump its FORMAT when this changes. */
#define CPUD_GEMM_NB 32

/* y[M][N] = x[M][K] @ W[N][K]^T (+ bias), fp32 accumulation. */
int cpud_gemm_packed(int isa,
                     intptr_t x,      /* [M][K], row stride x_stride, x_dtype         */
                     int x_dtype, int64_t x_stride,
                     intptr_t packed, /* [ceil(N/32)][ceil(K/2)][32][2] bf16           */
                     intptr_t bias,   /* [N] bias_dtype, or 0                          */
                     int bias_dtype,
                     intptr_t out,    /* [M][N], row stride out_stride, out_dtype      */
                     int out_dtype, int64_t out_stride, int64_t M, int64_t N, int64_t K);

/* Packs rows [row0, row0 + nrows) of a W[N][K] into the layout above (rows
 * given at w, row stride w_stride elements, w_dtype), rounding fp32 to bf16 and
 * zero-filling the k padding; other rows are untouched.  Any ISA; OpenMP over
 * the panels the rows cover.  The caller keeps row0 + nrows within the panels. */
int cpud_pack_rows(intptr_t w, /* [nrows][K], row stride w_stride, w_dtype          */
                   int w_dtype, int64_t w_stride,
                   intptr_t packed, /* [ceil(N/32)][ceil(K/2)][32][2] bf16             */
                   int64_t K, int64_t row0, int64_t nrows);

/* Streaming read of bytes at buf (64-byte aligned, bytes % 4096 == 0) by all
 * threads, each its own contiguous share; returns a checksum.  Fill buf with
 * random data: on some machines constant pages read measurably slower. */
uint64_t cpud_read_probe(int isa, intptr_t buf /* [bytes] */, int64_t bytes);

/* Every thread of a parallel region runs iters x 16 independent register multiply-adds of
 * the tier's widest kind (vdpbf16ps on avx512bf16); returns the FLOPs done, or -1 for a bad
 * isa or iters < 0.  Timed by the caller: the tier's instruction peak. */
double cpud_compute_probe(int isa, int64_t iters);

/* Inside one parallel region of n threads, thread i pins itself to cpus[i] and
 * writes sched_getcpu() to out_cpus[i] (-1: no such thread, -2: pin failed).
 * Returns the number of threads that ran. */
int cpud_pin_threads(const int *cpus, int n, int *out_cpus);
/* sched_getcpu() of each thread of an n-thread parallel region. */
int cpud_thread_cpus(int n, int *out_cpus);

/* ---------------------------------------------------------------------------
 * Shared-memory collectives for the tensor-parallel ranks of one machine
 * (shm_allreduce.c).  One segment, mapped by every rank, holds a header, one
 * control block per rank (own cache lines: sequence counter, round metadata,
 * pid) and two data slots of slot_bytes per rank.  A collective is a series
 * of rounds; in round g each rank copies its chunk into its slot g & 1,
 * publishes seq = g (release) and waits until every peer's seq >= g
 * (acquire): pause-spin, then sched_yield, then short sleeps.  Two slots per
 * rank make a reader-done flag unnecessary: a rank reaches round g + 2 only
 * after every peer has arrived at g + 1, i.e. finished reading round g.
 * Sums run over ranks 0..world-1 in that order on every rank (bit-identical
 * results), in fp32 for bf16.  Waits end with CPUD_ETIMEDOUT after timeout_ns
 * (<= 0: never), CPUD_EPEERDEAD when the missing peer's process is gone, or
 * CPUD_EABORTED once any member or the owner called cpud_shm_abort; the first
 * two also abort the group, so the other ranks stop waiting promptly.
 * *peer receives the rank at fault (-1 when unknown).  One handle per rank,
 * used by one thread at a time.
 * ------------------------------------------------------------------------- */
#define CPUD_SHM_MAX_WORLD 64
enum cpud_shm_err {
    CPUD_ETIMEDOUT = -4, /* a peer did not arrive in time            */
    CPUD_EPEERDEAD = -5, /* a peer's process is gone                 */
    CPUD_EABORTED = -6,  /* the group was aborted                    */
    CPUD_EMISMATCH = -7, /* a peer ran another collective or size    */
    CPUD_EBUSY = -8,     /* the rank is already attached             */
    CPUD_EHEADER = -9    /* not a cpud segment, or another layout    */
};
typedef struct cpud_shm cpud_shm;

/* Bytes of a segment for world ranks with data slots of slot_bytes (a
 * multiple of 4096); -1 if out of range. */
int64_t cpud_shm_segment_bytes(int world, int64_t slot_bytes);
/* Writes the header into a fresh zero-filled mapping of bytes at base. */
int cpud_shm_init(intptr_t base, int64_t bytes, int world, int64_t slot_bytes);
/* A handle on the mapping at base: rank >= 0 joins as that rank (records its
 * pid, prefaults its slots so the pages land on its NUMA node); rank -1
 * observes (abort and seq only).  NULL with *err set on failure. */
cpud_shm *cpud_shm_open(intptr_t base, int64_t bytes, int rank, int world, int isa, int *err);
void cpud_shm_close(cpud_shm *h);
int64_t cpud_shm_slot_bytes(const cpud_shm *h);
/* Published round count of rank r (its last completed-or-current round). */
uint64_t cpud_shm_seq(const cpud_shm *h, int r);
/* Pid rank r attached with (0: not attached yet). */
int cpud_shm_pid(const cpud_shm *h, int r);
/* Makes every current and future wait of the group fail with CPUD_EABORTED;
 * culprit: the rank at fault, or -1.  The first abort wins. */
void cpud_shm_abort(cpud_shm *h, int culprit);
/* -2: not aborted; else the culprit given to the first abort (-1: unknown). */
int cpud_shm_abort_culprit(const cpud_shm *h);

/* data += every other rank's data, in place (sum in rank order). */
int cpud_shm_all_reduce(cpud_shm *h, int dtype,
                        intptr_t data, /* [n] dtype, contiguous */
                        int64_t n, int64_t timeout_ns, int *peer);
/* Rank 0: out[r][p*cols + c] = data of rank p [r][c]; other ranks pass out = 0. */
int cpud_shm_gather_last_dim(cpud_shm *h, int elem_size,
                             intptr_t data, /* [rows][cols] of elem_size bytes        */
                             int64_t rows, int64_t cols,
                             intptr_t out,  /* rank 0: [rows][world * cols], else 0 */
                             int64_t timeout_ns, int *peer);
int cpud_shm_barrier(cpud_shm *h, int64_t timeout_ns, int *peer);

/* ---------------------------------------------------------------------------
 * A stack of decoder layers in one call (decoder.c), run as the recipe in
 * cpud_decoder_dims says: per layer
 *   residual += x; x = norm(residual)               (input_norm)
 *   qkv = x W_qkv^T (+ f32 bias); q, k per-head norm (optional);
 *   rotary with the layer's cos_sin (none where it is 0; neox or gpt-j pairs)
 *   k, v -> KV cache at slots; attn = paged attention(q) (the layer's window)
 *   x = attn W_o^T; all-reduce(x) (tp); x += o_bias (optional);
 *   x = norm(x) (attn_out_norm, optional); x = dt(x * residual_scale) (unless 1)
 *   residual += x; x = norm(residual)               (post_norm)
 *   x = act_and_mul(x W_gate_up^T) W_down^T (act: silu or gelu_tanh), or the
 *   expert layer; all-reduce(x) (tp);
 *   x = norm(x) (ffn_out_norm, optional); x = dt(x * residual_scale) (unless 1)
 * with the same kernels and the same rounding as the per-op entry points
 * (every norm cpud_rms_norm / cpud_fused_add_rms_norm with w_dtype norm_wdt).
 * Index data (positions, slots, block tables) is checked once, before the
 * first layer.  Weights are packed (cpud_pack_rows) or quantized (cpud_qlinear,
 * cpud_quant_gemm, qkv_bias then in the parts).  Before the first layer
 * x holds the embeddings and residual zeros; after the last, x holds the last
 * feed-forward output (normed and scaled as above) and residual the sum it is
 * added to.
 * ------------------------------------------------------------------------- */
/* A linear kept quantized (cpud_quant_gemm's layout): parts[i] computes output columns
 * [n[0] + .. + n[i-1], + n[i]) in type qtype[i], with an optional [n[i]] f32 bias.
 * parts 0: the linear is bf16, packed for cpud_gemm_packed. */
typedef struct cpud_qlinear {
    int64_t parts; /* 0 .. 3 */
    int qtype[3];
    int64_t n[3];
    intptr_t qs[3], sc[3], bias[3];
} cpud_qlinear;

typedef struct cpud_decoder_layer {
    intptr_t input_norm, post_norm; /* [H] norm_wdt                                */
    intptr_t q_norm, k_norm;        /* [hd] norm_wdt, or both 0                     */
    intptr_t qkv, qkv_bias;         /* packed [(nh + 2 nkv) hd, H]; [.] f32 or 0    */
    intptr_t o, o_bias;             /* packed [H, nh hd]; [H] dtype or 0            */
    intptr_t gate_up, down;         /* packed [2 I, H], [H, I]                      */
    intptr_t key_cache, value_cache; /* [num_blocks][nkv][bs] rows of dims' kv_dtype */
    intptr_t sinks;                  /* [heads] f32 attention sink logits, or 0      */
    cpud_qlinear q_qkv, q_o, q_gate_up, q_down; /* used instead where parts > 0     */
    intptr_t cos_sin; /* [max_pos][rot_dim] f32 cos | sin of this layer's RoPE, or 0: no rotary
                         in this layer (NoPE) */
    int64_t window;   /* this layer's sliding window in tokens (0: global) */
    /* [H] norm_wdt weights applied to the attention output and to the feed-forward output
     * before their residual add (Gemma's post_attention_layernorm / post_feedforward_layernorm),
     * or 0 */
    intptr_t attn_out_norm, ffn_out_norm;
    /* An expert layer: a cpud_moe * that cpud_moe_layer runs instead of gate_up / down, or 0. */
    intptr_t moe;
} cpud_decoder_layer;

typedef struct cpud_decoder_dims {
    int dtype;
    int64_t hidden, heads, kv_heads, head_dim, rot_dim, intermediate;
    int64_t max_pos, num_blocks, block_size;
    float eps, scale;
    int quant_flags;  /* cpud_quant_gemm's flags for quantized linears */
    int norm_wdt;    /* dtype of every norm weight: dtype (Llama rounding) or CPUD_F32 (Gemma
                        form) */
    int activation;  /* 0: silu (gated), 1: gelu_tanh (gated); expert layers: silu only */
    int rotary_neox; /* 1: neox (rotate halves), 0: gpt-j pairs */
    float residual_scale; /* each block's output (attention, feed-forward) is multiplied by it
                             before its residual add (Granite's residual_multiplier); 1: none */
    int kv_dtype; /* the KV cache's rows: CPUD_BF16 or a cpud_kv_dtype (quantized rows always
                     rotated, as cpud_write_kv_cache's kv_rotated), or 0: dtype */
} cpud_decoder_dims;

typedef struct cpud_decoder_step {
    int64_t T, S, max_blocks;
    intptr_t positions, slots;         /* [T] int64                                  */
    intptr_t query_start_loc, seq_lens; /* [S + 1], [S] int32                        */
    intptr_t block_tables;             /* [S][max_blocks] int32                       */
    intptr_t x, residual;              /* [T][H] dtype, contiguous                    */
    intptr_t qkv, attn, gate_up, act;  /* scratch [T][(nh + 2 nkv) hd], [T][nh hd],
                                          [T][2 I], [T][I] dtype, contiguous          */
    int64_t allreduce_ns, allreduce_calls; /* out: time in and number of all-reduces */
    int failed_collective; /* out: 1 when the return code is an all-reduce's (CPUD_E*) */
    int64_t linear_ns;     /* out: time in the dense layers' linears (their GEMMs) */
    int team;              /* out: 1 when the step ran as one thread team (decode steps: up to
                              32 tokens), 0 when op by op */
} cpud_decoder_step;

/* Layers [0, n_layers) in order.  tp: the tensor-parallel group's handle, or
 * NULL for a single rank; timeout_ns and *peer as in cpud_shm_all_reduce. */
int cpud_decoder_layers(int isa, const cpud_decoder_dims *d, const cpud_decoder_layer *layers,
                        int64_t n_layers, cpud_decoder_step *s, cpud_shm *tp,
                        int64_t timeout_ns, int *peer);

/* Mixture-of-experts feed-forward (moe.c): out[T][H] (dtype) = for each token t the sum over
 * its k routed experts e = ids[t][j] of weights[t][j] * down_e(silu(gate_e x) * up_e x).
 * gate_up: E packed [2 I][H] (gate rows, then up rows), down: E packed [H][I], each laid out
 * as for cpud_gemm_packed, back to back.  Tokens are grouped by expert and each routed
 * expert's GEMMs run once over its tokens; experts no token routes to are not read. */
int cpud_moe_experts(int isa, int dtype, intptr_t x, /* [T][H] dtype, contiguous */
                     int64_t T, int64_t H, int64_t I, intptr_t gate_up, intptr_t down, int64_t E,
                     intptr_t weights, /* [T][k] f32 */
                     intptr_t ids,     /* [T][k] int32 in [0, E) */
                     int64_t k, intptr_t out /* [T][H] dtype, contiguous */);

/* The whole expert layer: router logits x router^T (packed [E][H], rounded to dtype), routing
 * (softmax in fp32, top k, ties to the lower id; flags below) and cpud_moe_experts on the
 * result.  x and out may be the same rows. */
#define CPUD_MOE_MAX_K 64
enum cpud_moe_flags { CPUD_MOE_RENORMALIZE = 1, CPUD_MOE_WEIGHTS_IN_DTYPE = 2 };
int cpud_moe_ffn(int isa, int dtype, intptr_t x, int64_t T, int64_t H, int64_t I, int64_t E,
                 int64_t k, int flags, intptr_t router, intptr_t gate_up, intptr_t down,
                 intptr_t out);

/* A whole expert layer as its recipe says (cpud.model.moe_recipe.MoeRecipe).  Experts are bf16
 * stacks as for cpud_moe_experts (qtype -1, *_sc 0), or quantized stacks: expert e's [N][K] in
 * cpud_quant_gemm's layout (qs, sc) at e times its bytes from the start (x and the activations
 * quantized to int8 once, every routed expert's rows in one parallel region). */
enum cpud_moe_router { CPUD_MOE_SOFTMAX_TOPK = 0, CPUD_MOE_TOPK_SOFTMAX = 1 };
enum cpud_moe_activation { CPUD_MOE_SILU = 0, CPUD_MOE_SWIGLU_OAI = 1 };
typedef struct cpud_moe {
    int64_t E, k, H, I;   /* experts, routed per token, hidden, intermediate (this rank's)  */
    int flags;            /* cpud_moe_flags                                              */
    int router_kind;      /* cpud_moe_router; topk_softmax: softmax over the k raw logits */
    int activation;       /* cpud_moe_activation; swiglu_oai: g = min(g, limit),
                             u = clamp(u, -limit, limit), (u + 1) g sigmoid(alpha g)      */
    float swiglu_alpha, swiglu_limit;
    int quant_flags;      /* cpud_quant_gemm's flags for quantized stacks                 */
    intptr_t router, router_bias;     /* packed [E][H] bf16; [E] f32 or 0 (cpud_moe_layer) */
    int gate_up_qtype, down_qtype;    /* cpud_qtype of each stack, or -1: bf16 packed      */
    intptr_t gate_up, gate_up_sc;     /* [2I][H] per expert (gate rows, then up rows)      */
    intptr_t down, down_sc;           /* [H][I] per expert                                 */
    intptr_t gate_up_bias, down_bias; /* [E][2I], [E][H] f32, or 0                        */
} cpud_moe;
/* The routed experts of m on given weights and ids (as cpud_moe_experts). */
int cpud_moe_routed(int isa, int dtype, const cpud_moe *m, intptr_t x, int64_t T,
                    intptr_t weights, intptr_t ids, intptr_t out);
/* Router, routing and experts of m on x [T][H]; x and out may be the same rows. */
int cpud_moe_layer(int isa, int dtype, const cpud_moe *m, intptr_t x, int64_t T, intptr_t out);

/* ---------------------------------------------------------------------------
 * GEMM on GGUF-quantized weights (quant_*.c).  Rows of W[N][K] are repacked
 * once (cpud.native.quant.pack_quantized) into groups of CPUD_QROWS rows:
 *   qs: [ceil(N/16)][K/bs][qbytes] u8, sc: [ceil(N/16)][K/bs][sbytes] u8
 * (bs, qbytes, sbytes per type: quant_formats.h; rows past N are zero).  Every quant is
 * an unsigned byte; the 4 consecutive k of one row share a dword and 16 rows'
 * dwords form one 64-byte dot operand.  x is quantized per row to int8 blocks
 * of 32 (scale amax/127, round to nearest even) and dotted in int32.
 * ------------------------------------------------------------------------- */
#define CPUD_QROWS 16
/* The codes of quant_formats.h, where each type's bs, qbytes and sbytes are. */
enum cpud_qtype {
    CPUD_Q8_0 = 0,
    CPUD_Q4_0 = 1,
    CPUD_Q4_1 = 2,
    CPUD_Q4_K = 3,
    CPUD_Q5_K = 4,
    CPUD_Q6_K = 5,
    CPUD_MXFP4 = 6
};
/* flags for cpud_quant_gemm.  The amx tier runs cpud_quant_bf16_min_m rows of x and more (64;
 * Q6_K 32) on AMX-BF16 tiles (bf16 x, each 16-row weight group dequantized to bf16 once per
 * call), from 16 rows up to there on AMX-INT8 tiles
 * (tdpbssd, per-32 scales in fp32 after each tile product) where the CPU has them, fewer with
 * AVX512-VNNI; NO_AMX keeps it to AVX512-VNNI, NO_AMX_BF16 to the int8 kernels. */
#define CPUD_QUANT_NO_VNNI 1
#define CPUD_QUANT_NO_AMX 2
#define CPUD_QUANT_NO_AMX_BF16 4

/* out[M][N] = x[M][K] @ W^T (+ bias); W as packed above. */
int cpud_quant_gemm(int isa, int flags, int qtype,
                    intptr_t x,    /* [M][K], row stride x_stride, x_dtype          */
                    int x_dtype, int64_t x_stride,
                    intptr_t qs,   /* [ceil(N/16)][K/bs][qbytes] u8, 64-byte aligned */
                    intptr_t sc,   /* [ceil(N/16)][K/bs][sbytes] u8                  */
                    intptr_t bias, /* [N] f32, or 0                                  */
                    intptr_t out,  /* [M][N], row stride out_stride, out_dtype      */
                    int out_dtype, int64_t out_stride, int64_t M, int64_t N, int64_t K);
/* out[M][n[0] + .. + n[parts-1]] = x[M][K] @ the parts of q (parts 1..3) side by side, as
 * cpud_quant_gemm per part gives bit for bit; x is quantized once, and where the vector kernels
 * run (below 16 rows on the amx tier, every M on the others) one parallel region covers every
 * part. */
int cpud_quant_linear(int isa, int flags, const cpud_qlinear *q, intptr_t x, int x_dtype,
                      int64_t x_stride, intptr_t out, int out_dtype, int64_t out_stride,
                      int64_t M, int64_t K);
/* Name of the kernel cpud_quant_gemm runs for (isa, flags), e.g. "avx512-vnni". */
const char *cpud_quant_kernel(int isa, int flags);
/* Rows of x from which cpud_quant_gemm runs qtype on AMX-BF16 tiles; 0: never at (isa, flags);
 * -1: bad isa or qtype. */
int cpud_quant_bf16_min_m(int isa, int flags, int qtype);
/* Every thread runs iters rounds of independent 16-row int8 dots of that kernel in registers
 * (12 chains of zmm vpdpbusd or vpmaddubsw + vpmaddwd; avx2: 6 of ymm pairs; scalar: 1;
 * amx-int8: 4 chains of 16 x 16 x 64 tdpbssd tiles);
 * returns the int8 ops (2 per multiply-add) done, -1 on a bad isa. */
double cpud_quant_compute_probe(int isa, int flags, int64_t iters);
/* qtype's GGUF type id, values and bytes per GGUF block, and packed bytes of quants and of
 * scales per block of CPUD_QROWS rows (quant_formats.h); CPUD_EARG for a bad qtype. */
int cpud_quant_format(int qtype, int *ggml_type, int *block_values, int *block_bytes,
                      int *qbytes, int *sbytes);
/* Repacks E matrices W[N][K] (a stack of experts, or E = 1) from their GGUF blocks into the
 * layout above, expert e at e times one matrix's bytes from qs and sc (quant_pack.c).  rows:
 * [E][N] addresses of each row's K / bs consecutive blocks of qtype (read only: e.g. rows of the
 * mapped file); rows past N pack as all-zero blocks.  *nan_scales: the MXFP4 blocks whose E8M0
 * byte is 0xff (NaN in OCP MX; packed as any other), 0 for other types.  CPUD_EARG for a bad
 * qtype, E or N < 1, K not a positive multiple of bs, or a null pointer or row (nothing written
 * then). */
int cpud_quant_pack(int qtype, intptr_t rows, /* [E][N] int64 addresses */
                    int64_t E, int64_t N, int64_t K,
                    intptr_t qs, /* [E][ceil(N/16)][K/bs][qbytes] u8 */
                    intptr_t sc, /* [E][ceil(N/16)][K/bs][sbytes] u8 */
                    int64_t *nan_scales);

/* Rows of a table kept in GGUF blocks (an embedding lookup; dequant_rows.c), in the operations
 * and order of gguf-py's numpy dequantize (f32 rows equal it bit for bit).  ggml_type: gguf's
 * type id, one of Q8_0 8, Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q4_K 12, Q5_K 13, Q6_K 14, MXFP4 39.
 * table: n_rows rows row_stride bytes apart, each starting with cols / block_values consecutive
 * blocks (row_stride at least their bytes: a table's column range is a strided view); ids:
 * [n_ids] int64; out: [n_ids][cols] of out_dtype (CPUD_F32 or CPUD_BF16, rounded to nearest
 * even).  CPUD_EARG for another type, sizes that disagree or an id outside [0, n_rows) (nothing
 * written then). */
int cpud_dequant_rows(int ggml_type, intptr_t table, int64_t n_rows, int64_t row_stride,
                      int64_t cols, intptr_t ids, int64_t n_ids, intptr_t out, int out_dtype);
/* Values and bytes per block of a type cpud_dequant_rows reads; CPUD_EARG for any other. */
int cpud_dequant_rows_format(int ggml_type, int *block_values, int *block_bytes);

#endif
