"""The amx tier's weight unpacking (quant_amx.c cpud_qamx_unpack), every format of the table,
on any AVX-512 CPU: it runs no tile instruction, so its output is checked here also where the
tiles themselves cannot run.  It gives one packed group (16 rows) as signed int8 B operands
[K/4][16 rows][4 k] with fp32 scales sw and mins mw per kt values: each weight must be
sw * b + mw, gguf's dequantized value up to fp32 rounding (gguf computes d * sc * q - dmin * m
in another order)."""

from __future__ import annotations

import ctypes
import importlib

import numpy as np
import pytest
from test_quant_gemm import weight

from cpud import native
from cpud.native import quant
from cpud.native.quant_formats import KERNEL_FORMATS

pytestmark = pytest.mark.skipif(
    not native.available(), reason=f"native kernels not built: {native.load_error()}"
)


def aligned(count: int, dtype: type) -> np.ndarray:
    """A zeroed array of count items starting on a 64-byte boundary (the unpacker's stores)."""
    size = np.dtype(dtype).itemsize
    raw = np.zeros(count * size + 64, np.uint8)
    skip = -raw.ctypes.data % 64
    return raw[skip : skip + count * size].view(dtype)


def unpack_group(code: int, qs: int, sc: int, nb: int, k: int, kt: int) -> tuple[np.ndarray, ...]:
    """cpud_qamx_unpack of one group: (b [16, k] int8, sw [16, k / kt], mw [16, k / kt])."""
    library = ctypes.CDLL(importlib.import_module("cpud.native._cpud_native").__file__)
    fn = library.cpud_qamx_unpack
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn.argtypes += [ctypes.c_void_p] * 3
    b, sw, mw = (
        aligned(k * 16, np.int8),
        aligned(k // kt * 16, np.float32),
        aligned(k // kt * 16, np.float32),
    )
    fn(code, qs, sc, nb, b.ctypes.data, sw.ctypes.data, mw.ctypes.data)
    q = b.reshape(k // 4, 16, 4).transpose(1, 0, 2).reshape(16, k)
    return q, sw.reshape(k // kt, 16).T, mw.reshape(k // kt, 16).T


@pytest.mark.parametrize("name", list(KERNEL_FORMATS))
def test_unpacked_group_is_ggufs_weights(name):
    if "avx512" not in native.supported_isas():  # the unpacker is AVX-512 code
        return
    fmt = KERNEL_FORMATS[name]
    n, k = 16, 512
    raw, w, _ = weight(name, n, k)
    packed = quant.pack_quantized(raw, name, n, k, huge_pages=False)
    kt = fmt.scale_values
    q, sw, mw = unpack_group(
        fmt.code, packed.qs.data_ptr(), packed.sc.data_ptr(), k // fmt.block_values, k, kt
    )
    got = np.repeat(sw, kt, axis=1) * q.astype(np.float64) + np.repeat(mw, kt, axis=1)
    np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6 * np.abs(w).max())
