/* Quantized GEMM, AVX-512 variant without VNNI: vpmaddubsw + vpmaddwd on zmm. */
#include "quant_simd_avx512.h"

#include "quant_kernels.h"

QUANT_OPS(cpud_qops_avx512, "avx512 maddubs");
