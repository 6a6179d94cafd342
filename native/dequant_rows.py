"""Rows of a table kept in GGUF blocks, dequantized in native code (an embedding lookup):

    if dequant_rows_supported(qtype):
        out = dequant_rows(data, qtype, columns, ids, torch.bfloat16)   # [len(ids), columns]

``data`` is the table's [rows, bytes per row] uint8 array in file layout (rows may be a strided
view, bytes within a row contiguous).  The f32 values equal gguf-py's ``gguf.quants.dequantize``
bit for bit (the same f32 operations in the same order); bf16 rows are those rounded to nearest
even.  Types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from . import _loader
from .kernels import DTYPE_CODE, check_rc


@functools.cache
def dequant_rows_supported(ggml_type: int) -> bool:
    """Whether the native row dequantization reads this GGUF type id (and the module loaded):
    fixed for the process, so asked of the library once per type."""
    if not _loader.available():
        return False
    return (
        _loader.lib.cpud_dequant_rows_format(int(ggml_type), _loader.ffi.NULL, _loader.ffi.NULL)
        == 0
    )


def dequant_rows(
    data: np.ndarray, ggml_type: int, columns: int, ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Rows ``ids`` of ``data`` as [len(ids), columns] of dtype; ValueError for an id outside
    [0, rows) or sizes that disagree with the type."""
    if data.ndim != 2 or data.dtype != np.uint8 or data.strides[1] != 1:
        raise ValueError(f"table must be [rows, bytes] uint8, each row contiguous: {data.shape}")
    index = ids.reshape(-1).to(torch.int64).contiguous()
    code = DTYPE_CODE.get(dtype, DTYPE_CODE[torch.float32])
    out = torch.empty(index.numel(), columns, dtype=torch.bfloat16 if code else torch.float32)
    rc = _loader.lib.cpud_dequant_rows(
        int(ggml_type),
        data.ctypes.data,
        data.shape[0],
        data.strides[0],
        columns,
        index.data_ptr(),
        index.numel(),
        out.data_ptr(),
        code,
    )
    hint = f"ids must lie in [0, {data.shape[0]}) and rows hold {columns} values"
    check_rc(rc, "dequant_rows", hint)
    return out if out.dtype == dtype else out.to(dtype)
