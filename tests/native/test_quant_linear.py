"""cpud_quant_linear: the parts of one linear (types may differ) side by side in one call must
equal cpud_quant_gemm per part into its columns bit for bit, on every kernel variant here, with
and without biases, fp32 and bf16, at every row count (one parallel region below the tiles, one
call per part on them); bad parts are refused."""

from __future__ import annotations

import pytest
import torch
from test_quant_gemm import VARIANTS, weight

from cpud.native import quant

K = 512
# Q4_K_M files mix Q4_K and Q6_K in one linear; Q8_0 and Q4_1 share k = 512 too
MIXES = [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q4_1"), ("Q6_K",), ("Q5_K", "Q4_0", "Q8_0")]
MIXES += [("MXFP4", "MXFP4", "MXFP4"), ("MXFP4", "Q8_0")]  # gpt-oss: attention Q8_0, experts MXFP4


def packed_parts(names: tuple[str, ...], biased: bool) -> list[quant.QuantWeight]:
    parts = []
    for i, name in enumerate(names):
        n = (96, 250, 17)[i]
        raw = weight(name, n, K)[0]
        bias = torch.randn(n, generator=torch.Generator().manual_seed(i)) if biased else None
        parts.append(quant.pack_quantized(raw, name, n, K, bias=bias))
    return parts


@pytest.mark.parametrize("isa, vnni", VARIANTS)
@pytest.mark.parametrize("names", MIXES)
@pytest.mark.parametrize("M", [1, 3, 5, 16, 33, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parts_equal_per_part_gemms(isa, vnni, names, M, dtype):
    parts = packed_parts(names, biased=M % 2 == 1)
    x = (torch.randn(M, K, generator=torch.Generator().manual_seed(M)) * 2).to(dtype)
    got = quant.quant_linear(x, parts, isa=isa, vnni=vnni)
    want, col = torch.empty_like(got), 0
    for p in parts:
        quant.quant_gemm(x, p, want[:, col : col + p.n], isa=isa, vnni=vnni)
        col += p.n
    assert got.shape == (M, sum(p.n for p in parts))
    assert torch.equal(got, want)


def test_bad_parts_are_refused():
    parts = packed_parts(("Q8_0", "Q4_1"), biased=False)
    x = torch.randn(2, K)
    with pytest.raises(ValueError, match="1 to 3"):
        quant.quant_linear(x, [])
    with pytest.raises(ValueError, match="1 to 3"):
        quant.quant_linear(x, parts * 2)
    other_k = quant.pack_quantized(weight("Q8_0", 96, 256)[0], "Q8_0", 96, 256)
    with pytest.raises(ValueError, match="one k"):
        quant.quant_linear(x, [parts[0], other_k])
    with pytest.raises(ValueError):
        quant.quant_linear(torch.randn(2, K + 32), parts)
