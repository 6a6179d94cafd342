"""GEMM on GGUF-quantized weights vs two references, every type on every kernel variant here.

Exact reference: x quantized the kernel's way (blocks of 32, scale amax / 127 in fp32, q =
rint(x * (127 / amax)) in fp32) then x_q @ W^T in fp64 with W from gguf.quants.dequantize: the
kernel differs only by fp32 rounding, bounded by 1e-5 * (|x_q| @ |W|^T).
Float reference: x @ W^T in fp64 on the unquantized x.  Rounding x to int8 moves each element
by at most d_x / 2 (d_x = its block's amax / 127), so |error| <= (d_x / 2) @ |W|^T, plus the fp32
term; a bf16 output adds 2^-8 relative.  Weights: Q8_0 / Q4_0 / Q4_1 quantized by gguf from
Gaussians; K-quants (gguf cannot quantize them) are random bytes with small positive fp16 d,
dmin, which is every valid block.  MXFP4: gguf-quantized Gaussians too (its values are E2M1 codes
doubled times 2^(e - 128), exact in fp32); tests/test_mxfp4.py adds every code and extreme
exponents.
The amx tier runs 16+ rows on AMX-INT8 tiles with the same integer dots and the same fp32
operations in the same order as AVX512-VNNI, so there its results must equal those bit for bit.
From bf16_tile_rows(qtype) rows it runs AMX-BF16 tiles on weights dequantized to bf16 (fp32
sw * q + mw, rounded to nearest even) and x rounded to bf16, accumulating in fp32.  Reference:
bf16(x) @ bf16(W)^T in fp64 with W from gguf.  The products of bf16 values are exact in fp32;
what remains is fp32 accumulation (1e-5 relative to |x| @ |W|^T, as above) and the rare weight
whose fp32 value, computed in another order than gguf's, rounds to the neighbouring bf16: one
bf16 ulp (2^-8 relative) on a few weights, bounded by 2^-8 |x| @ |W|^T over the few differing
weights; the test allows that on at most 1 in 1000 weights' worth (2^-8 * 1e-3 relative).
The int8 kernels' error against the unquantized x is 1-2 orders above that bound, so passing it
also shows the bf16 path ran.
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
VARIANTS = (
    [("scalar", True)]
    + [(isa, v) for isa in ("avx2", "avx512") if isa in TIERS for v in (False, True)]
    + [("amx", True)] * ("amx" in TIERS)
)
MS = [1, 2, 3, 7, 16, 17, 31, 32, 33, 64, 512]
NS = [1, 7, 96, 250]
KS = {"Q8_0": [32, 96, 160, 512], "Q4_0": [96, 160, 256], "Q4_1": [32, 160, 256]}
KS.update({t: [256, 512] for t in ("Q4_K", "Q5_K", "Q6_K")})
KS["MXFP4"] = [32, 96, 160, 512]
GGUF_QUANTIZES = ("Q8_0", "Q4_0", "Q4_1", "MXFP4")  # gguf.quants can write these


@functools.cache
def weight(name: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray, quant.QuantWeight]:
    """(raw GGUF rows [n, bytes], dequantized W [n, k] fp64, packed)."""
    rng = np.random.default_rng(n * 7919 + k)
    _, bs, tsize, _, _ = quant.QTYPES[name]
    if name in GGUF_QUANTIZES:
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
        out = quant.quant_gemm(x, packed, isa=isa, vnni=vnni, amx_bf16=False)
        assert out.shape == (M, N) and out.dtype == torch.float32
        check(out, x, w)


@pytest.mark.parametrize("name", list(quant.QTYPES))
@pytest.mark.parametrize("M", [1, 3, 70])
def test_same_bits_on_every_thread_count(name, M):
    """Each thread runs its share of the tasks, then takes tasks from the shares of the others
    (task_steal.h).  At 1, 2, 3 and 7 threads (more threads than CPUs here, so some start late
    and have their shares taken) every output element is computed once, with the same bits."""
    K = KS[name][-1]
    _, w, packed = weight(name, 1000, K)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3, 7):
            torch.set_num_threads(n)
            outs += [quant.quant_gemm(x, packed, amx_bf16=False) for _ in range(3)]
    finally:
        torch.set_num_threads(threads)
    check(outs[0], x, w)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize("isa", TIERS)
@pytest.mark.parametrize("name", list(quant.QTYPES))
@pytest.mark.parametrize("M", [5, 21])
def test_every_tier_bf16_strides_bias(isa, name, M):
    N, K = 40, 512
    raw, w, _ = weight(name, N, K)
    bias = torch.randn(N)
    packed = quant.pack_quantized(torch.from_numpy(raw), T[name], N, K, bias=bias)
    xbuf = torch.randn(M, K + 64).to(torch.bfloat16)
    x = xbuf[:, 32 : 32 + K]
    obuf = torch.full((M, N + 3), 7.0, dtype=torch.bfloat16)
    assert quant.quant_gemm(x, packed, obuf[:, :N], isa=isa, amx_bf16=False) is not None
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


@pytest.mark.parametrize("name", list(quant.QTYPES))
@pytest.mark.parametrize("M", [16, 17, 31, 32, 33, 64, 512])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_amx_tiles_equal_vnni(name, M, out_dtype):
    if "amx" not in TIERS:
        assert not quant.quant_kernel().startswith("amx")
        return
    assert quant.quant_kernel("amx", amx_bf16=False) == "amx amx-int8"
    assert quant.quant_kernel("amx", amx=False) == "avx512 avx512-vnni"
    N = 250
    for K in KS[name] + [768] * (name in ("Q4_K", "Q5_K", "Q6_K")):
        raw, _, _ = weight(name, N, K)
        packed = quant.pack_quantized(raw, name, N, K, bias=torch.randn(N))
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M + K)) * 3
        tiles = quant.quant_gemm(
            x, packed, torch.empty(M, N, dtype=out_dtype), isa="amx", amx_bf16=False
        )
        vnni = quant.quant_gemm(x, packed, torch.empty(M, N, dtype=out_dtype), "amx", amx=False)
        assert torch.equal(tiles, vnni), (K, (tiles - vnni).abs().max())


def test_kernel_names_and_probe():
    for isa, vnni in VARIANTS:
        name = quant.quant_kernel(isa, vnni)
        assert name.startswith(isa)
        assert vnni or "vnni" not in name
        assert quant.quant_compute_probe(10, isa, vnni) > 0


def bf16_round(a: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(a)).to(torch.bfloat16).double().numpy()


def check_bf16(out: torch.Tensor, x: torch.Tensor, w: np.ndarray, bias: torch.Tensor | None):
    xb, wb = bf16_round(x.float().numpy()), bf16_round(w)
    b = 0.0 if bias is None else bias.double().numpy()
    ref = xb @ wb.T + b
    mag = np.abs(xb) @ np.abs(wb).T
    tol = (1e-5 + 2.0**-8 * 1e-3) * mag + 1e-7
    if out.dtype == torch.bfloat16:
        tol = tol + 2.0**-8 * np.abs(ref)
    np.testing.assert_array_less(np.abs(out.double().numpy() - ref), tol)


# K: odd multiples of the block
BF16_KS = {"Q8_0": [96, 160], "Q4_0": [96, 160], "Q4_1": [32, 160]}
BF16_KS.update({t: [256, 768] for t in ("Q4_K", "Q5_K", "Q6_K")})
BF16_KS["MXFP4"] = [96, 160]


@pytest.mark.parametrize("name", list(quant.QTYPES))
@pytest.mark.parametrize("N", [7, 250])
def test_bf16_tiles(name, N):
    """The amx tier from bf16_tile_rows rows: bf16 weights and x, fp32 sums; below: int8."""
    if "amx" not in TIERS:
        assert all(quant.bf16_tile_rows(name, isa) is None for isa in TIERS)
        return
    rows = quant.bf16_tile_rows(name, "amx")
    assert rows is not None and rows >= 16
    assert quant.bf16_tile_rows(name, "amx", amx_bf16=False) is None
    assert quant.bf16_tile_rows(name, "amx", amx=False) is None
    for K in BF16_KS[name]:
        _, w, packed = weight(name, N, K)
        for M in sorted({rows - 1, rows, 65, 512}):
            x = torch.randn(M, K, generator=torch.Generator().manual_seed(M * 7 + K)) * 2
            got = quant.quant_gemm(x, packed, isa="amx")
            int8 = quant.quant_gemm(x, packed, isa="amx", amx_bf16=False)
            if M < rows:
                assert torch.equal(got, int8)
                continue
            check_bf16(got, x, w, None)
            full = x.double().numpy() @ w.T
            err_bf16 = np.abs(got.double().numpy() - full).mean()
            err_int8 = np.abs(int8.double().numpy() - full).mean()
            assert err_bf16 < err_int8, (M, K, err_bf16, err_int8)


@pytest.mark.parametrize("name", list(quant.QTYPES))
def test_bf16_tiles_bf16_io_strides_bias(name):
    if "amx" not in TIERS:
        assert quant.quant_kernel() == quant.quant_kernel(amx_bf16=False)
        return
    assert quant.quant_kernel("amx") == "amx amx-int8+bf16"
    M, N, K = 97, 40, 512
    raw, w, _ = weight(name, N, K)
    bias = torch.randn(N)
    packed = quant.pack_quantized(raw, name, N, K, bias=bias)
    x = torch.randn(M, K + 64).to(torch.bfloat16)[:, 32 : 32 + K]
    obuf = torch.full((M, N + 3), 7.0, dtype=torch.bfloat16)
    quant.quant_gemm(x, packed, obuf[:, :N], isa="amx")
    check_bf16(obuf[:, :N], x, w, bias)
    assert torch.all(obuf[:, N:] == 7.0)
