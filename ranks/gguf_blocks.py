"""A rank's slice of one GGUF tensor, in two steps: `slice_blocks` picks rows and a whole-block
column range straight from the memory-mapped file, still in the tensor's own block format;
`to_dense` turns such blocks into a torch tensor of the model's dtype (gguf's dequantizers,
a bounded number of rows at a time).  MXFP4 blocks whose scale byte is 0xFF (NaN in OCP MX)
are refused at the slice, whichever path reads them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize

from cpud.native.mxfp4 import check_mxfp4_scales
from cpud.native.quant_formats import FORMATS
from cpud.settings.errors import ConfigError

T = GGMLQuantizationType
DEQUANT_VALUES = 1 << 22  # values dequantized per chunk: a 16 MiB fp32 scratch at most


@dataclass(frozen=True)
class Blocks:
    """Rows of a tensor in its stored format: `data` is [rows, bytes per row] uint8 (a view of
    the file when the rows are contiguous), `shape` the (rows, columns) of values it holds."""

    qtype: GGMLQuantizationType
    data: np.ndarray
    shape: tuple[int, int]


def tensor_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    """Hugging Face order: (rows, columns) for a matrix, (n,) for a vector."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def slice_blocks(
    tensor: ReaderTensor, rows: slice | np.ndarray, columns: slice = slice(None)
) -> Blocks:
    """Rows (a range or an index array) and a column range of `tensor`; a vector is one row.
    The column range must start and end on block boundaries."""
    shape = tensor_shape(tensor)
    n_rows, n_cols = (1, shape[0]) if len(shape) == 1 else shape
    fmt = FORMATS.get(tensor.tensor_type.name)
    if fmt is None:
        raise ConfigError(
            f"tensor {tensor.name} is {tensor.tensor_type.name}, a type cpud does not read "
            f"(supported: {', '.join(FORMATS)})"
        )
    block, type_size = fmt.block_values, fmt.block_bytes
    raw = tensor.data.view(np.uint8).reshape(n_rows, -1)
    start, stop, step = columns.indices(n_cols)
    if step != 1 or start % block or stop % block:
        raise ConfigError(
            f"tensor {tensor.name} ({tensor.tensor_type.name}) cannot be read from column "
            f"{start} to {stop}: its blocks hold {block} values"
        )
    picked = raw[rows, start // block * type_size : stop // block * type_size]
    count = len(range(*rows.indices(n_rows))) if isinstance(rows, slice) else len(rows)
    if tensor.tensor_type == T.MXFP4:
        try:
            check_mxfp4_scales(picked[:, ::type_size], f"tensor {tensor.name}")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return Blocks(tensor.tensor_type, picked, (count, stop - start))


def _float_rows(qtype: GGMLQuantizationType, data: np.ndarray) -> torch.Tensor:
    if qtype == T.F32:
        return torch.from_numpy(data.view(np.float32).copy())
    if qtype == T.F16:
        return torch.from_numpy(data.view(np.float16).copy())
    if qtype == T.BF16:
        return torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(dequantize(data, qtype))


def to_dense(blocks: Blocks, dtype: torch.dtype) -> torch.Tensor:
    """The values as a [rows, columns] tensor of dtype."""
    rows, cols = blocks.shape
    chunk = max(1, DEQUANT_VALUES // max(cols, 1))
    if rows <= chunk:
        return _float_rows(blocks.qtype, blocks.data).to(dtype).reshape(rows, cols)
    out = torch.empty((rows, cols), dtype=dtype)
    for r0 in range(0, rows, chunk):
        out[r0 : r0 + chunk] = _float_rows(blocks.qtype, blocks.data[r0 : r0 + chunk])
    return out


def expert_blocks(source, expert: int, rows: slice, columns: slice = slice(None)) -> Blocks:
    """Rows and a whole-block column range of `expert` from a GGUF loader's tensor source
    (ranks/gguf_loader.py's TensorSource over a 3-D tensor), still in blocks."""
    tensor = source.tensor
    shape = tensor_shape(tensor)
    if len(shape) != 3:
        raise ConfigError(f"tensor {tensor.name} has shape {shape}, not [experts, rows, columns]")
    experts, n_rows, n_cols = shape
    fmt = FORMATS[tensor.tensor_type.name]
    block, type_size = fmt.block_values, fmt.block_bytes
    start, stop, _ = columns.indices(n_cols)
    if start % block or stop % block:
        raise ConfigError(
            f"tensor {tensor.name} ({tensor.tensor_type.name}) cannot be read from column "
            f"{start} to {stop}: its blocks hold {block} values"
        )
    raw = tensor.data.view(np.uint8).reshape(experts, n_rows, -1)
    picked = raw[expert, rows, start // block * type_size : stop // block * type_size]
    count = len(range(*rows.indices(n_rows)))
    return Blocks(tensor.tensor_type, picked, (count, stop - start))


def expert_rows(source, expert: int, rows: slice, columns: slice = slice(None)) -> torch.Tensor:
    """One expert's rows and whole-block columns, dense in the source's dtype."""
    return to_dense(expert_blocks(source, expert, rows, columns), source.dtype)
