/* GEMM kernels of the amx tier (tier_amx.c): the avx512bf16 micro-kernel (gemm_avx512bf16.h)
 * below GEMM_AMX_MIN_M rows, AMX-BF16 tiles from there on (the driver's GEMM_BLOCK path), and a
 * compute probe on tdpbf16ps; the contract is in gemm_shape.h, the driver in tier_gemm.h. */
#include "gemm_avx512bf16.h"

/* Tiles 0-3 hold a 32 x 32 fp32 block of C (rows 0-15 / 16-31 x columns
 * 0-15 / 16-31), 4-5 two 16 x 32 bf16 blocks of x, 6-7 the panel's two column halves for 16 k
 * pairs, which the packed layout already is: row kp of a half is 16 columns x (k, k + 1), 64
 * bytes at a 128-byte stride.  Used from GEMM_AMX_MIN_M rows (fewer are bound by the weight
 * stream, where the vdpbf16ps micro-kernel is as fast) and for K a multiple of 32. */
#define GEMM_AMX_MIN_M 4
#define GEMM_AMX_KP 16 /* k pairs per tile step */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

/* Every tile 16 rows x 64 bytes; this thread's tile state until amx_release. */
static TGT void amx_configure(void) {
    amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}

static TGT void amx_release(void) { __asm__ volatile("tilerelease" ::); }

static ALWAYS_INLINE TGT void gemm_block_begin(void) { amx_configure(); }
static ALWAYS_INLINE TGT void gemm_block_end(void) { amx_release(); }

static int gemm_block_fits(int64_t M, int64_t nkp) {
    return M >= GEMM_AMX_MIN_M && nkp % GEMM_AMX_KP == 0;
}

/* Rows of x per chunk: ~1 MiB of bf16, whole 32-row blocks, so a chunk stays in L2 while every
 * panel of the weights streams past it (re-reading all of x from L3 per panel is slower). */
static int64_t gemm_block_chunk_rows(int64_t M, int64_t kpad) {
    const int64_t rows = ((int64_t)1 << 20) / (2 * kpad) / GEMM_MT * GEMM_MT;
    return rows < GEMM_MT ? GEMM_MT : rows > M ? M : rows;
}

/* The 2 KiB of weights one tile step reads, 4 KiB ahead (on the first row block of a panel,
 * which reads it from memory): M=32 GEMMs 1.2-1.6x faster than with the hardware prefetcher
 * alone, which stops at every 4 KiB page; 2 or 8 KiB ahead, or into L2 only, no better. */
static ALWAYS_INLINE TGT void amx_prefetch(const uint16_t *w) {
    const char *p = (const char *)w + 4096;
    for (int l = 0; l < 32; l++) _mm_prefetch(p + 64 * l, _MM_HINT_T0);
}

/* panel: [nkp][32][2] bf16; x: [mt][xs] bf16 (rows beyond mt readable up to 16 or 32);
 * c: [32][32] f32 <- x @ panel, rows >= mt garbage; prefetch: the panel comes from memory */
static TGT void gemm_block(const uint16_t *panel, int64_t nkp, const uint16_t *x, int64_t xs,
                           int64_t mt, float *c, int prefetch) {
    const long wstride = 2 * GEMM_NB * 2, xstride = xs * 2;
    const uint16_t *x1 = x + 16 * xs;
    _tile_zero(0);
    _tile_zero(1);
    if (mt > 16) {
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kp = 0; kp < nkp; kp += GEMM_AMX_KP) {
            const uint16_t *w = panel + kp * 2 * GEMM_NB;
            if (prefetch) amx_prefetch(w);
            _tile_loadd(6, w, wstride);
            _tile_loadd(7, w + GEMM_NB, wstride);
            _tile_loadd(4, x + 2 * kp, xstride);
            _tile_loadd(5, x1 + 2 * kp, xstride);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(2, c + 16 * GEMM_NB, GEMM_NB * 4);
        _tile_stored(3, c + 16 * GEMM_NB + 16, GEMM_NB * 4);
    } else {
        for (int64_t kp = 0; kp < nkp; kp += GEMM_AMX_KP) {
            const uint16_t *w = panel + kp * 2 * GEMM_NB;
            if (prefetch) amx_prefetch(w);
            _tile_loadd(6, w, wstride);
            _tile_loadd(7, w + GEMM_NB, wstride);
            _tile_loadd(4, x + 2 * kp, xstride);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
    }
    _tile_stored(0, c, GEMM_NB * 4);
    _tile_stored(1, c + 16, GEMM_NB * 4);
}

#define GEMM_BLOCK 1

/* tdpbf16ps on four independent 16 x 16 accumulator tiles: 16 x 16 x 32 multiply-adds per
 * instruction */
static ALWAYS_INLINE TGT double amx_compute_probe(int64_t iters, float *total) {
    uint16_t ab[16 * 32] __attribute__((aligned(64)));
    float cs[16 * 16] __attribute__((aligned(64)));
    for (int i = 0; i < 16 * 32; i++) ab[i] = 0x3f80; /* 1.0 */
    amx_configure();
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, ab, 64);
    _tile_loadd(6, ab, 64);
    for (int64_t it = 0; it < iters; it++)
        for (int i = 0; i < 4; i++) {
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 6);
            _tile_dpbf16ps(2, 4, 6);
            _tile_dpbf16ps(3, 4, 6);
        }
    _tile_stored(3, cs, 64);
    amx_release();
    for (int i = 0; i < 16 * 16; i++) *total += cs[i];
    return (double)iters * 16 * 16 * 16 * 32 * 2;
}
#undef GEMM_COMPUTE_PROBE
#define GEMM_COMPUTE_PROBE amx_compute_probe
