"""Tolerances for comparing kernels with their torch references."""

from __future__ import annotations

import torch

# Tolerances against torch references computed in fp32 (then rounded like HF).
# bf16 results may differ by a couple of bf16 ulps (2**-8 relative each) from
# summation order, the vectorised exp and rsqrt; fp32 results by float rounding.
TOL = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2},
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale=1.0):
    tol = TOL[dtype]
    torch.testing.assert_close(
        actual.float(), expected.float(), rtol=tol["rtol"], atol=tol["atol"] * scale
    )
