/* The GGUF formats cpud loads, one line each: the only place their sizes and codes are written.
 * An X-macro table: define the macros you need, include this file (it has no include guard and
 * undefines all three at its end).  cpud.native.quant_formats parses these same lines, so write
 * each entry on one line, starting at column 0.
 *
 * CPUD_FLOAT_FORMAT(name, ggml_type, bytes)
 *     a float type, loaded as-is (one value per block).
 * CPUD_DEQUANT_FORMAT(name, ggml_type, block_values, block_bytes)
 *     a block type dequantized at load: no kernel reads its blocks.
 * CPUD_KERNEL_FORMAT(name, ggml_type, block_values, block_bytes, code, qbytes, sbytes, family,
 *                    scale_values, mins, bf16_min_m)
 *     a block type the quantized GEMM runs on (quant_*.c).  code: its enum cpud_qtype value
 *     (cpud_native.h; 0, 1, ... with no gap).  qbytes, sbytes: packed quants and scales per block
 *     of CPUD_QROWS rows (cpud.native.quant.pack_quantized).  family: the block kernel that
 *     reads them (quant_kernels.h blk_<family>: b32 one scale per 32, k45 the 4/5-bit K-quants,
 *     q6k, e2m1 MXFP4's 4-bit E2M1 codes through their value table, one E8M0 scale per 32).
 *     scale_values: k one weight scale covers (the AMX tiles' KT).  mins: 1 where a weight
 *     is scale * q - min.  bf16_min_m: rows of x from which the amx tier runs AMX-BF16 tiles on
 *     dequantized groups (measured: a group's dequantization costs about what 30-60 rows of
 *     int8 tile products and their fp32 rescaling cost; Q6_K's rescaling, per 16 k, twice that;
 *     MXFP4's 64 is Q4_0's, not measured on its own).
 */
#ifndef CPUD_FLOAT_FORMAT
#define CPUD_FLOAT_FORMAT(name, ggml_type, bytes)
#endif
#ifndef CPUD_DEQUANT_FORMAT
#define CPUD_DEQUANT_FORMAT(name, ggml_type, block_values, block_bytes)
#endif
#ifndef CPUD_KERNEL_FORMAT
#define CPUD_KERNEL_FORMAT(name, ggml_type, block_values, block_bytes, code, qbytes, sbytes,       \
                           family, scale_values, mins, bf16_min_m)
#endif

CPUD_FLOAT_FORMAT(F32, 0, 4)
CPUD_FLOAT_FORMAT(F16, 1, 2)
CPUD_FLOAT_FORMAT(BF16, 30, 2)
CPUD_KERNEL_FORMAT(Q8_0, 8, 32, 34, 0, 512, 32, b32, 32, 0, 64)
CPUD_KERNEL_FORMAT(Q4_0, 2, 32, 18, 1, 256, 32, b32, 32, 0, 64)
CPUD_KERNEL_FORMAT(Q4_1, 3, 32, 20, 2, 256, 64, b32, 32, 1, 64)
CPUD_DEQUANT_FORMAT(Q5_0, 6, 32, 22)
CPUD_DEQUANT_FORMAT(Q5_1, 7, 32, 24)
CPUD_KERNEL_FORMAT(Q4_K, 12, 256, 144, 3, 2048, 320, k45, 32, 1, 64)
CPUD_KERNEL_FORMAT(Q5_K, 13, 256, 176, 4, 2560, 320, k45, 32, 1, 64)
CPUD_KERNEL_FORMAT(Q6_K, 14, 256, 210, 5, 3072, 288, q6k, 16, 0, 32)
CPUD_KERNEL_FORMAT(MXFP4, 39, 32, 17, 6, 256, 16, e2m1, 32, 0, 64)

#undef CPUD_FLOAT_FORMAT
#undef CPUD_DEQUANT_FORMAT
#undef CPUD_KERNEL_FORMAT
