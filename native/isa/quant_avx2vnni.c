/* Quantized GEMM, AVX2 with AVX-VNNI: vpdpbusd on ymm (gcc >= 11, clang >= 12; with an older
 * compiler the variant is not built and never chosen). */
#include "quant.h"

#if CPUD_CAN_AVXVNNI
#define QUANT_VNNI 1
#include "quant_simd_avx2.h"

#include "quant_kernels.h"

QUANT_OPS(cpud_qops_avx2_vnni, "avx2 avx-vnni");
#else
const cpud_qops cpud_qops_avx2_vnni;
#endif
