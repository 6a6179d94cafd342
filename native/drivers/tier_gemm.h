/* Skinny GEMM y[M][N] = x[M][K] @ W[N][K]^T over the packed weight layout
 * [ceil(N/32)][ceil(K/2)][32][2] bf16 (see cpud_native.h), plus the streaming read probe and the
 * compute probe it is measured against: the driver, shared by every tier.  A tier file includes
 * its ISA's kernels (gemm_<isa>.h, whose contract gemm_shape.h states) and then this header.
 *
 * Work split: each thread owns a contiguous range of 32-column panels, so it
 * streams one contiguous region of the packed weights exactly once (for
 * M <= GEMM_MT); a thread done with its range takes panels from the back of a
 * slower one's (work_ranges.h), so a descheduled thread costs one panel.  When
 * M exceeds what the micro-kernel holds in registers, K is blocked so that the
 * panel slice is re-read from L1, not from memory.  An ISA with a block kernel (GEMM_BLOCK: the
 * amx tier's tiles) runs whole row blocks on it instead, and splits large M into chunks of x that
 * stay in L2: its work items are (chunk, panel) pairs. */

#include "work_ranges.h"

#define GEMM_KC 128 /* k pairs per block when M > GEMM_MR: 16 KiB of panel */

/* Dispatch to a micro-kernel specialised for mr rows (mr <= GEMM_MR). */
static TGT void gemm_ukernel(int mr, const uint16_t *w, int64_t nkp, const xelem *x, int64_t xs,
                             float *c, int first, const uint16_t *pf, int64_t npf) {
    switch (mr) {
#define UK_CASE(n)                                                                                 \
    case n: gemm_uk(n, w, nkp, x, xs, c, first, pf, npf); break;
    UK_CASE(1)
    UK_CASE(2)
#if GEMM_MR > 2
    UK_CASE(3)
    UK_CASE(4)
#endif
#if GEMM_MR > 4
    UK_CASE(5)
    UK_CASE(6)
    UK_CASE(7)
    UK_CASE(8)
#endif
#undef UK_CASE
    default: break;
    }
}

/* x: [K] row of xdt -> dst: [kpad] xelem, zero padded */
static TGT void gemm_prep_row(const void *x, int xdt, int64_t K, xelem *dst, int64_t kpad) {
    for (int64_t k = 0; k < K; k++) {
        const float v = ld1(x, k, xdt);
#if GEMM_X_BF16
        dst[k] = xdt == CPUD_BF16 ? ((const uint16_t *)x)[k] : f32_to_bf16(v);
#else
        dst[k] = v;
#endif
    }
    for (int64_t k = K; k < kpad; k++) dst[k] = 0;
}

/* c: [mt][32] f32 tile of columns [n0, n0 + 32) -> out rows (stride os) of odt, + bias */
static ALWAYS_INLINE TGT void gemm_store(const float *c, int64_t mt, int64_t n0, int64_t N,
                                         const float *bias32, void *out, int64_t os, int odt) {
    const int64_t nv = N - n0 < GEMM_NB ? N - n0 : GEMM_NB;
    for (int64_t r = 0; r < mt; r++) {
        void *o = at(out, r * os + n0, odt);
        int64_t i = 0;
        for (; i + VW <= nv; i += VW)
            stv(o, i, vf_add(vf_ld(c + r * GEMM_NB + i), vf_ld(bias32 + i)), odt);
        for (; i < nv; i++) st1(o, i, c[r * GEMM_NB + i] + bias32[i], odt);
    }
}

/* c: [mt][32] f32 <- x [mt][xs] @ panel [nkp][32][2] (work item `item` of range own), through
 * the micro-kernel.  When M exceeds what the micro-kernel holds in registers, K is blocked:
 * while the row groups re-read a block from L1, they prefetch the next one (of this panel, or of
 * the next panel, which follows it), each group an equal share, so the weights stream evenly
 * instead of in one burst per block. */
static TGT void gemm_tile(const uint16_t *panel, int64_t nkp, const xelem *x, int64_t xs,
                          int64_t mt, float *c, work_range *own, int64_t item) {
    const int64_t kc = mt <= GEMM_MR ? nkp : GEMM_KC;
    for (int64_t k0 = 0; k0 < nkp; k0 += kc) {
        const int64_t nk = nkp - k0 < kc ? nkp - k0 : kc;
        const int64_t groups = (mt + GEMM_MR - 1) / GEMM_MR;
        const int64_t share = (2 * kc + groups - 1) / groups;
        const int has_next = kc < nkp && (k0 + kc < nkp || work_has_after(own, item));
        const uint16_t *next = panel + (k0 + kc) * 2 * GEMM_NB;
        for (int64_t r0 = 0; r0 < mt; r0 += GEMM_MR)
            gemm_ukernel((int)(mt - r0 < GEMM_MR ? mt - r0 : GEMM_MR), panel + k0 * 2 * GEMM_NB, nk,
                         x + r0 * xs + 2 * k0, xs, c + r0 * GEMM_NB, k0 == 0,
                         next + r0 / GEMM_MR * share * 32, has_next ? share : 0);
    }
}

/* One packed GEMM (arguments as cpud_gemm_packed) and how it runs: x prepared or read in
 * place, tile kernel, rows per chunk of x, items (chunk, panel). */
typedef struct gemm_job {
    const void *x;
    int xdt;
    int64_t xs;
    const uint16_t *packed;
    const void *bias;
    int bdt;
    void *out;
    int odt;
    int64_t os, M, N, K;
    int64_t nkp, kpad, np, xrows, mc, items;
    int wide, direct, block;
} gemm_job;

static TGT gemm_job gemm_job_of(const void *x, int xdt, int64_t xs, const uint16_t *packed,
                                const void *bias, int bdt, void *out, int odt, int64_t os,
                                int64_t M, int64_t N, int64_t K) {
    gemm_job j = {.x = x, .xdt = xdt, .xs = xs, .packed = packed, .bias = bias, .bdt = bdt,
                  .out = out, .odt = odt, .os = os, .M = M, .N = N, .K = K};
    j.nkp = (K + 1) / 2;
    j.kpad = 2 * j.nkp;
    j.np = (N + GEMM_NB - 1) / GEMM_NB;
#ifdef GEMM_WIDE
    j.wide = M >= GEMM_WIDE_MIN_M; /* x prepared in row groups for gemm_tile_wide */
    j.xrows = j.wide ? (M + GEMM_WIDE_MR - 1) / GEMM_WIDE_MR * GEMM_WIDE_MR : M;
#else
    j.wide = 0;
    j.xrows = M;
#endif
    j.direct = !j.wide && xdt == GEMM_XDT && K % 2 == 0;
#ifdef GEMM_BLOCK
    j.block = gemm_block_fits(M, j.nkp);
    j.mc = j.block ? gemm_block_chunk_rows(M, j.kpad) : M;
#else
    j.block = 0;
    j.mc = M;
#endif
    /* chunk-major, so a thread's contiguous range runs through all panels against one chunk
     * of x, which stays in its L2 */
    j.items = j.np * ((M + j.mc - 1) / j.mc);
    return j;
}

/* x's rows (or row groups of the wide kernel) [u0, u1) into xp, as the kernels read it. */
static TGT void gemm_prep_units(const gemm_job *j, xelem *xp, int64_t u0, int64_t u1) {
#ifdef GEMM_WIDE
    if (j->wide) {
        for (int64_t u = u0; u < u1; u++)
            gemm_prep_group(j->x, j->xdt, j->xs, u * GEMM_WIDE_MR, j->M, j->K,
                            xp + u * GEMM_WIDE_MR * j->kpad, j->kpad);
        return;
    }
#endif
    for (int64_t m = u0; m < u1; m++)
        gemm_prep_row(at(j->x, m * j->xs, j->xdt), j->xdt, j->K, xp + m * j->kpad, j->kpad);
}

/* Units gemm_prep_units prepares: rows, or the wide kernel's row groups. */
static TGT int64_t gemm_prep_count(const gemm_job *j) {
#ifdef GEMM_WIDE
    if (j->wide) return (j->M + GEMM_WIDE_MR - 1) / GEMM_WIDE_MR;
#endif
    return j->M;
}

/* The items thread tid takes from ranges (nr of them: its own first, then others'), against x
 * prepared in xp (or x itself where j->direct); returns 1 when its scratch was short. */
static TGT int gemm_items_run(const gemm_job *j, const xelem *xp, work_range *ranges, int nr,
                              int tid) {
    const xelem *xv = j->direct ? (const xelem *)j->x : xp;
    const int64_t xvs = j->direct ? j->xs : j->kpad, M = j->M, N = j->N, np = j->np;
    const int64_t nkp = j->nkp, mc = j->mc;
    int failed = 0;
    float c[GEMM_MT * GEMM_NB] __attribute__((aligned(64)));
    float b32[GEMM_NB] __attribute__((aligned(64)));
#ifdef GEMM_BLOCK
    /* the last, partial block of rows, padded with zero rows: the block kernel reads whole
     * blocks */
    const int block = j->block;
    const int64_t kpad = j->kpad;
    xelem *tail = NULL;
    const int64_t tail0 = M / GEMM_MT * GEMM_MT;
    if (block) {
        gemm_block_begin();
        if (tail0 < M && (tail = aligned_alloc(64, GEMM_MT * kpad * sizeof(xelem))) != NULL) {
            memset(tail, 0, GEMM_MT * kpad * sizeof(xelem));
            for (int64_t m = tail0; m < M; m++)
                memcpy(tail + (m - tail0) * kpad, xv + m * xvs, j->K * sizeof(xelem));
        }
        if (tail0 < M && !tail) failed = 1;
    }
#endif
    for (int64_t item; !failed && (item = work_next(ranges, nr, tid)) >= 0;) {
        const int64_t p = item % np, m_end = item / np * mc + mc < M ? item / np * mc + mc : M;
        const uint16_t *panel = j->packed + p * nkp * 2 * GEMM_NB;
        for (int64_t i = 0; i < GEMM_NB; i++)
            b32[i] = j->bias && p * GEMM_NB + i < N ? ld1(j->bias, p * GEMM_NB + i, j->bdt) : 0.0f;
        for (int64_t m0 = item / np * mc; m0 < m_end; m0 += GEMM_MT) {
            const int64_t mt = m_end - m0 < GEMM_MT ? m_end - m0 : GEMM_MT;
#ifdef GEMM_BLOCK
            if (block) {
                if (m0 < tail0)
                    gemm_block(panel, nkp, xv + m0 * xvs, xvs, mt, c, m0 == item / np * mc);
                else
                    gemm_block(panel, nkp, tail, kpad, mt, c, m0 == item / np * mc);
            } else
#endif
#ifdef GEMM_WIDE
            if (j->wide)
                gemm_tile_wide(panel, nkp, xp + m0 * j->kpad, j->kpad, mt, c);
            else
#endif
                gemm_tile(panel, nkp, xv + m0 * xvs, xvs, mt, c, &ranges[tid], item);
            if (j->odt == CPUD_BF16)
                gemm_store(c, mt, p * GEMM_NB, N, b32, at(j->out, m0 * j->os, j->odt), j->os,
                           CPUD_BF16);
            else
                gemm_store(c, mt, p * GEMM_NB, N, b32, at(j->out, m0 * j->os, j->odt), j->os,
                           CPUD_F32);
        }
    }
#ifdef GEMM_BLOCK
    if (block) gemm_block_end();
    free(tail);
#endif
    return failed;
}

static TGT xelem *gemm_xp_alloc(const gemm_job *j) {
    return aligned_alloc(64, ((size_t)(j->xrows * j->kpad) * sizeof(xelem) + 63) & ~(size_t)63);
}

/* Arguments as cpud_gemm_packed; returns 0 or CPUD_ENOMEM.  Its own parallel region: x
 * prepared once, shared. */
static TGT int gemm_packed_k(const void *x, int xdt, int64_t xs, const uint16_t *packed,
                             const void *bias, int bdt, void *out, int odt, int64_t os, int64_t M,
                             int64_t N, int64_t K) {
    const gemm_job j = gemm_job_of(x, xdt, xs, packed, bias, bdt, out, odt, os, M, N, K);
    xelem *xp = NULL;
    if (!j.direct && !(xp = gemm_xp_alloc(&j))) return CPUD_ENOMEM;
    /* one range per thread the region may get; ranges of threads it does not get are stolen */
    const int nr = j.items > 1 ? omp_get_max_threads() : 1;
    int failed = 0;
    work_range *ranges = work_ranges_new(j.items, nr);
    if (!ranges) {
        free(xp);
        return CPUD_ENOMEM;
    }
#pragma omp parallel if (j.items > 1 && !omp_in_parallel()) reduction(| : failed)
    {
        if (!j.direct) {
            const int64_t units = gemm_prep_count(&j);
#pragma omp for schedule(static)
            for (int64_t u = 0; u < units; u++) gemm_prep_units(&j, xp, u, u + 1);
        }
        const int tid = omp_get_thread_num() < nr ? omp_get_thread_num() : 0;
        failed |= gemm_items_run(&j, xp, ranges, nr, tid);
    }
    free(ranges);
    free(xp);
    return failed ? CPUD_ENOMEM : CPUD_OK;
}

/* gemm_packed_k without a parallel region: thread tid of nth (every thread of the caller's team
 * calls it once) computes the items [items * tid / nth, items * (tid + 1) / nth), from x
 * prepared in its own scratch where the kernel needs it prepared (small M: decode). */
static TGT int gemm_packed_part_k(const void *x, int xdt, int64_t xs, const uint16_t *packed,
                                  const void *bias, int bdt, void *out, int odt, int64_t os,
                                  int64_t M, int64_t N, int64_t K, int tid, int nth) {
    const gemm_job j = gemm_job_of(x, xdt, xs, packed, bias, bdt, out, odt, os, M, N, K);
    const int64_t first = j.items * tid / nth, end = j.items * (tid + 1) / nth;
    if (end <= first) return CPUD_OK;
    xelem *xp = NULL;
    if (!j.direct) {
        if (!(xp = gemm_xp_alloc(&j))) return CPUD_ENOMEM;
        gemm_prep_units(&j, xp, 0, gemm_prep_count(&j));
    }
    work_range own; /* this thread's items alone: nothing to steal from or for others */
    atomic_init(&own.word, (uint64_t)end << 32 | (uint64_t)first);
    const int failed = gemm_items_run(&j, xp, &own, 1, 0);
    free(xp);
    return failed ? CPUD_ENOMEM : CPUD_OK;
}

/* ------------------------------------------------------------ read probe */

/* buf: [bytes] 64-byte aligned, bytes % 4096 == 0; each thread reads its
 * contiguous share (probe_range: the ISA's loop). */
static TGT uint64_t read_probe_k(const void *buf, int64_t bytes) {
    const int64_t pages = bytes / 4096;
    uint64_t sum = 0;
#pragma omp parallel reduction(^ : sum)
    {
        const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
        const char *b = (const char *)buf + pages * tid / nt * 4096;
        const char *e = (const char *)buf + pages * (tid + 1) / nt * 4096;
        sum ^= probe_range(b, e);
    }
    return sum;
}

/* ---------------------------------------------------------- compute probe */

/* iters rounds of independent multiply-adds of the tier's widest kind (GEMM_COMPUTE_PROBE:
 * vdpbf16ps, tdpbf16ps, vfmadd on zmm or ymm, scalar fmaf) per thread, all in registers: the
 * instruction peak the GEMM micro-kernel is measured against.  Returns the FLOPs done by all
 * threads; *sink takes a value that depends on every result, so nothing is optimised away. */
static TGT double compute_probe_k(int64_t iters, float *sink) {
    double flops = 0.0;
    float total = 0.0f;
#pragma omp parallel reduction(+ : flops, total)
    flops += GEMM_COMPUTE_PROBE(iters, &total);
    *sink = total;
    return flops;
}
