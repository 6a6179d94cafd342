/* Quantized GEMM, scalar reference variant. */
#include "quant_simd_scalar.h"

#include "quant_kernels.h"

QUANT_OPS(cpud_qops_scalar, "scalar");
