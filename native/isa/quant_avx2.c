/* Quantized GEMM, AVX2 variant without VNNI: vpmaddubsw + vpmaddwd. */
#include "quant_simd_avx2.h"

#include "quant_kernels.h"

QUANT_OPS(cpud_qops_avx2, "avx2 maddubs");
