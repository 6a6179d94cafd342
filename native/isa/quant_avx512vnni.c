/* Quantized GEMM, AVX-512 with AVX512-VNNI: vpdpbusd on zmm. */
#define QUANT_VNNI 1
#include "quant_simd_avx512.h"

#include "quant_kernels.h"

QUANT_OPS(cpud_qops_avx512_vnni, "avx512 avx512-vnni");
