"""The compute over weights kept in GGUF blocks: the quantized GEMM of a layer's parts and the
dequantized rows of an embedding table."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from cpud.native.dequant_rows import dequant_rows, dequant_rows_supported
from cpud.native.quant import QuantWeight, quant_gemm
from cpud.ranks.gguf_blocks import Blocks


def quant_matmul(
    x: torch.Tensor, parts: list[tuple[int, QuantWeight]], n: int, isa: str | None = None
) -> torch.Tensor:
    """x [..., K] @ W^T for a layer of quantized parts; [..., n] in x's dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    if len(parts) == 1 and parts[0][1].n == n:
        out = quant_gemm(x2, parts[0][1], isa=isa)
    else:
        out = torch.empty(x2.shape[0], n, dtype=x.dtype)
        for offset, weight in parts:
            quant_gemm(x2, weight, out[:, offset : offset + weight.n], isa=isa)
    return out.reshape(*lead, n)


def dequantize_rows(blocks: Blocks, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of a table kept in blocks, dequantized to dtype: [len(ids), columns]; native
    for the block types it reads (ValueError for an id outside the table), else gguf-py's."""
    if dequant_rows_supported(blocks.qtype):
        return dequant_rows(blocks.data, blocks.qtype, blocks.shape[1], ids, dtype)
    picked = blocks.data[ids.numpy()]
    values = dequantize(picked, GGMLQuantizationType(blocks.qtype)).reshape(len(ids), -1)
    return torch.from_numpy(values).to(dtype)
