"""GEMM on GGUF-quantized weights vs two references, every type on every kernel variant here.

Exact reference: x quantized the kernel's way (blocks of 32, scale amax / 127 in fp32, q =
rint(x * (127 / amax)) in fp32) then x_q @ W^T in fp64 with W from gguf.quants.dequantize: the
kernel differs only by fp32 rounding, bounded by 1e-5 * (|x_q| @ |W|^T).
Float reference: x @ W^T in fp64 on the unquantized x.  Rounding x to int8 moves each element
by at most d_x / 2 (d_x = its block's amax / 127), so |error| <= (d_x / 2) @ |W|^T, plus the fp32
term; a bf16 output adds 2^-8 relative.  Weights: Q8_0 / Q4_0 / Q4_1 quantized by gguf from
Gaussians; K-quants (gguf cannot quantize them) are random bytes with small positive fp16 d,
dmin, which is every valid block.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from cpud import native
from cpud.native import quant

TIERS = native.supported_isas()
# (tier, vnni): the distinct kernels each tier can run here
VARIANTS = [("scalar", True)] + [
    (isa, v) for isa in ("avx2", "avx512") if isa in TIERS for v in (False, True)
]
MS = [1, 2, 3, 7, 16, 33, 64, 512]
NS = [1, 7, 96, 250]
KS = {"Q8_0": [32, 96, 160, 512], "Q4_0": [96, 160, 256], "Q4_1": [32, 160, 256]}
KS.update({t: [256, 512] for t in ("Q4_K", "Q5_K", "Q6_K")})


@functools.cache
def weight(name: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray, quant.QuantWeight]:
    """(raw GGUF rows [n, bytes], dequantized W [n, k] fp64, packed)."""
    rng = np.random.default_rng(n * 7919 + k)
    _, bs, tsize, _, _ = quant.QTYPES[name]
    if name in ("Q8_0", "Q4_0", "Q4_1"):
        raw = quants.quantize(rng.standard_normal((n, k)).astype(np.float32), T[name])
    else:
        blk = rng.integers(0, 256, (n, k // bs, tsize), dtype=np.uint8)
        scale = (rng.random((n, k // bs, 2)) * 0.01 + 1e-3).astype(np.float16).view(np.uint8)
        if name == "Q6_K":
            blk[..., 208:210] = scale[..., :2]
        else:
            blk[..., 0:4] = scale
        raw = blk.reshape(n, -1)
    w = quants.dequantize(raw, T[name]).reshape(n, k).astype(np.float64)
    return raw, w, quant.pack_quantized(raw, name, n, k)


def quantize_x(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] fp32 -> (x_q as fp64 [M, K], d_x per element [M, K]), the kernel's rounding."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv)
    d = (amax / np.float32(127)).astype(np.float32)
    return (q * d.astype(np.float64)).reshape(x.shape), np.broadcast_to(d, blocks.shape).reshape(
        x.shape
    )


def check(out: torch.Tensor, x: torch.Tensor, w: np.ndarray, bias: torch.Tensor | None = None):
    xf = x.float().numpy()
    xq, dx = quantize_x(xf)
    b = 0.0 if bias is None else bias.double().numpy()
    got = out.double().numpy()
    exact = xq @ w.T + b
    fp = 1e-5 * (np.abs(xq) @ np.abs(w).T) + 1e-7
    if out.dtype == torch.bfloat16:
        fp = fp + 2.0**-8 * np.abs(exact)
    np.testing.assert_array_less(np.abs(got - exact), fp)
    bound = (0.5 * dx.astype(np.float64)) @ np.abs(w).T + fp
    np.testing.assert_array_less(np.abs(got - (xf.astype(np.float64) @ w.T + b)), bound)


@pytest.mark.parametrize("isa, vnni", VARIANTS)
@pytest.mark.parametrize("name", list(quant.QTYPES))
@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("N", NS)
def test_quant_gemm(isa, vnni, name, M, N):
    for K in KS[name]:
        _, w, packed = weight(name, N, K)
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M * 31 + K))
        out = quant.quant_gemm(x, packed, isa=isa, vnni=vnni)
        assert out.shape == (M, N) and out.dtype == torch.float32
        check(out, x, w)


@pytest.mark.parametrize("isa", TIERS)
@pytest.mark.parametrize("name", list(quant.QTYPES))
def test_every_tier_bf16_strides_bias(isa, name):
    M, N, K = 5, 40, 512
    raw, w, _ = weight(name, N, K)
    bias = torch.randn(N)
    packed = quant.pack_quantized(torch.from_numpy(raw), T[name], N, K, bias=bias)
    xbuf = torch.randn(M, K + 64).to(torch.bfloat16)
    x = xbuf[:, 32 : 32 + K]
    obuf = torch.full((M, N + 3), 7.0, dtype=torch.bfloat16)
    assert quant.quant_gemm(x, packed, obuf[:, :N], isa=isa) is not None
    check(obuf[:, :N], x, w, bias)
    assert torch.all(obuf[:, N:] == 7.0)


def test_zero_rows_and_errors():
    _, w, packed = weight("Q4_K", 7, 256)
    x = torch.zeros(3, 256)
    assert torch.all(quant.quant_gemm(x, packed) == 0)
    with pytest.raises(ValueError, match="K=128"):
        quant.quant_gemm(torch.zeros(1, 128), packed)
    with pytest.raises(ValueError, match="multiple of 256"):
        quant.pack_quantized(np.zeros((1, 144), np.uint8), "Q4_K", 1, 128)
    with pytest.raises(ValueError, match="not supported"):
        quant.qtype_name("Q2_K")
    assert packed.gguf_bytes == 7 * 144


def test_kernel_names_and_probe():
    for isa, vnni in VARIANTS:
        name = quant.quant_kernel(isa, vnni)
        assert name.startswith(isa)
        assert vnni or "vnni" not in name
        assert quant.quant_compute_probe(10, isa, vnni) > 0
