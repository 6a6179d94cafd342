/* What one ISA's GEMM header (gemm_<isa>.h) gives the driver (tier_gemm.h), and the panel
 * width both share.  A tier file includes its ISA's header, which includes this one, and then
 * tier_gemm.h.
 *
 * Every ISA header defines
 *   GEMM_MT, GEMM_MR    rows per C tile; rows the micro-kernel holds in registers (<= 8)
 *   GEMM_XDT, xelem     the dtype and element type the micro-kernel reads x in
 *   GEMM_X_BF16         1 when that is bf16, else 0
 *   gemm_uk             c[mr][32] (+)= x[mr][2 nkp] @ w[nkp][32][2], for constant mr <= GEMM_MR
 *   probe_range         the read probe's loop over one thread's range
 *   GEMM_COMPUTE_PROBE  the compute probe's loop on one thread: returns its FLOPs
 * and may define
 *   GEMM_WIDE           from GEMM_WIDE_MIN_M rows, x prepared in groups of GEMM_WIDE_MR rows by
 *                       gemm_prep_group and each C tile computed by gemm_tile_wide
 *   GEMM_BLOCK          where gemm_block_fits(M, nkp), each C tile computed by gemm_block from
 *                       whole GEMM_MT-row blocks of x (the last one zero padded), between
 *                       gemm_block_begin and gemm_block_end on each thread, over chunks of
 *                       gemm_block_chunk_rows(M, kpad) rows of x */
#ifndef CPUD_GEMM_SHAPE_H
#define CPUD_GEMM_SHAPE_H

#define GEMM_NB CPUD_GEMM_NB /* columns per panel */

#endif
