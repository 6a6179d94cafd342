"""GEMM straight on GGUF-quantized weights (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, MXFP4).

    packed = pack_quantized(raw, "Q4_K", n, k)   # once, at load: raw = [n, bytes per row] u8
    quant_gemm(x, packed, out)                   # out [M, n] = x [M, k] @ W^T, any tier

``pack_quantized`` reorders the file's blocks (no dequantized copy): 16 output rows per group, the 4
consecutive quants of each row in one dword so that one 64-byte operand feeds an int8 dot for 16
rows, every quant unsigned (Q8_0 + 128), K-quant 6-bit scales unpacked to bytes; MXFP4 keeps its
4-bit E2M1 codes (the kernels map them to values through a 16-entry table) and its E8M0 exponent
bytes.  Packed bytes are the file's bytes plus 0 % (Q8_0, Q4_0, Q4_1, Q6_K, MXFP4), 2.3 % (Q5_K),
2.8 % (Q4_K) and the rows that pad N to 16.  ``quant_gemm`` quantizes x per row to int8 blocks of 32
(scale amax / 127, round to nearest even) and runs int8 dot products: on the amx tier AMX-INT8 tiles
(tdpbssd on the packed groups, unpacked to signed bytes once per 16 rows of weights) from 16 rows of
x, vpdpbusd (AVX512-VNNI, AVX-VNNI) where the CPU has it, else vpmaddubsw + vpmaddwd, or the scalar
reference.  The amx int8 tiles give the same results as AVX512-VNNI, bit for bit.  From
``bf16_tile_rows(qtype)`` rows of x (64; Q6_K 32) the amx tier instead dequantizes each 16-row
weight group to bf16 once per call and runs AMX-BF16 tiles (tdpbf16ps) on x rounded to bf16: no int8
rounding of x, no per-block rescaling, and the weights still stream at their quantized size;
``amx_bf16=False`` keeps those calls on the int8 kernels.  The avx512bf16 tier keeps the int8
kernels at every M: there cpud's own vdpbf16ps GEMM, the bound of a dequantizing kernel, runs at a
third to a fifth of the AVX512-VNNI kernels' rate on these blocks (measured).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import _loader
from .hugepages import huge_empty
from .kernels import _require, check_rc, gemm_io
from .mxfp4 import check_mxfp4_scales
from .quant_formats import KERNEL_FORMATS

ROWS = 16  # CPUD_QROWS
NO_VNNI = 1  # CPUD_QUANT_NO_VNNI
NO_AMX = 2  # CPUD_QUANT_NO_AMX
NO_AMX_BF16 = 4  # CPUD_QUANT_NO_AMX_BF16

# name: (cpud_qtype, values per block, bytes per GGUF block, packed quant bytes, scale bytes),
# the last two per block of ROWS rows: KERNEL_FORMATS (quant_formats.h) as tuples.
QTYPES: dict[str, tuple[int, int, int, int, int]] = {
    f.name: (f.code, f.block_values, f.block_bytes, f.qbytes, f.sbytes)
    for f in KERNEL_FORMATS.values()
}


@dataclass(frozen=True)
class QuantWeight:
    """A W[n, k] in GGUF type ``qtype``, repacked for ``quant_gemm``.

    qs: [ceil(n/16), k/bs, qbytes] u8 quants; sc: [ceil(n/16), k/bs, sbytes] u8 scales;
    bias: [n] fp32 or None.
    """

    qtype: str
    n: int
    k: int
    qs: torch.Tensor
    sc: torch.Tensor
    bias: torch.Tensor | None = None

    @property
    def weight_bytes(self) -> int:
        """Bytes streamed per call (packed, padding rows included)."""
        return self.qs.numel() + self.sc.numel()

    @property
    def gguf_bytes(self) -> int:
        """Bytes of the same rows in the GGUF file."""
        fmt = KERNEL_FORMATS[self.qtype]
        return self.n * (self.k // fmt.block_values) * fmt.block_bytes


def qtype_name(qtype: Any) -> str:
    """ "Q4_K" for "Q4_K", "q4_k" or gguf's GGMLQuantizationType.Q4_K; ValueError otherwise."""
    name = str(getattr(qtype, "name", qtype)).upper()
    if name not in KERNEL_FORMATS:
        raise ValueError(f"qtype {qtype!r} not supported; one of {', '.join(KERNEL_FORMATS)}")
    return name


def _u8(raw: np.ndarray | torch.Tensor) -> np.ndarray:
    return raw.numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)


def _row_bytes(name: str, n: int, k: int) -> int:
    """Bytes of one row of W[n, k] in GGUF blocks of `name`; ValueError for a shape it cannot
    hold."""
    fmt = KERNEL_FORMATS[name]
    if n < 1 or k < 1 or k % fmt.block_values:
        raise ValueError(f"{name}: k={k} must be a positive multiple of {fmt.block_values} (n={n})")
    return k // fmt.block_values * fmt.block_bytes


def _dense_rows(arr: np.ndarray, row_bytes: int) -> np.ndarray:
    """arr as [rows, row_bytes] rows of dense bytes: a view where arr has that form (e.g. a
    column range of the mapped file), else a copy."""
    rows = arr.reshape(-1, row_bytes)
    return rows if rows.strides[1] == 1 else np.ascontiguousarray(rows)


def _bad_rows(what: str, n: int, row_bytes: int, parts: list[np.ndarray]) -> ValueError:
    got = " + ".join(f"{a.dtype} {a.shape}" for a in parts)
    return ValueError(f"{what}: expected {n} x {row_bytes} uint8, got {got}")


def pack_rows_into(
    sources: Sequence[Sequence[np.ndarray | torch.Tensor]],
    qtype: Any,
    n: int,
    k: int,
    qs: torch.Tensor,
    sc: torch.Tensor,
) -> None:
    """Repacks E = len(sources) matrices W[n, k] into qs [E, ceil(n/16), k/bs, qbytes] and sc
    [E, ceil(n/16), k/bs, sbytes] (contiguous uint8), in one native call on every thread.
    sources[e]: matrix e's rows as u8 arrays of [rows, bytes per row] blocks stacked in order
    (e.g. an expert's gate rows, then its up rows), each a view of the mapped file or any array
    with dense rows; nothing is copied.  ValueError for rows that do not add up to [n, bytes
    per row] u8 or an MXFP4 block whose scale is 0xFF (NaN in OCP MX)."""
    name = qtype_name(qtype)
    fmt = KERNEL_FORMATS[name]
    bs, tsize = fmt.block_values, fmt.block_bytes
    row_bytes, groups = _row_bytes(name, n, k), -(-n // ROWS)
    for t, size in ((qs, fmt.qbytes), (sc, fmt.sbytes)):
        shape = (len(sources), groups, k // bs, size)
        if tuple(t.shape) != shape or t.dtype != torch.uint8 or not t.is_contiguous():
            raise ValueError(
                f"packed tensors: expected a contiguous uint8 {shape}, got {t.dtype} "
                f"{tuple(t.shape)}"
            )
    table = np.empty((len(sources), n), np.int64)
    kept = []  # the row arrays the table points into, alive through the call
    for e, parts in enumerate(sources):
        arrays = [_u8(p) for p in parts]
        if any(a.dtype != np.uint8 or a.size % row_bytes for a in arrays) or (
            sum(a.size for a in arrays) != n * row_bytes
        ):
            raise _bad_rows("raw" if len(sources) == 1 else f"raw of {e}", n, row_bytes, arrays)
        at = 0
        for a in arrays:
            rows = _dense_rows(a, row_bytes)
            base = rows.__array_interface__["data"][0]
            table[e, at : at + len(rows)] = base + np.arange(len(rows)) * rows.strides[0]
            at += len(rows)
            kept.append(rows)
    _require()
    nans = _loader.ffi.new("int64_t *")
    rc = _loader.lib.cpud_quant_pack(
        fmt.code, table.ctypes.data, len(sources), n, k, qs.data_ptr(), sc.data_ptr(), nans
    )
    check_rc(rc, f"quant_pack {name}")
    if nans[0]:
        for e, parts in enumerate(sources):
            rows = np.concatenate([_dense_rows(_u8(p), row_bytes) for p in parts])
            what = "MXFP4 weights" if len(sources) == 1 else f"MXFP4 weights of {e}"
            check_mxfp4_scales(rows.reshape(n, k // bs, tsize)[..., 0], what)


def _plain_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def pack_quantized(
    raw: np.ndarray | torch.Tensor,
    qtype: Any,
    n: int,
    k: int,
    bias: torch.Tensor | None = None,
    huge_pages: bool = True,
    alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
) -> QuantWeight:
    """Repacks the GGUF blocks of W[n, k] (raw: [n, bytes per row] u8, numpy or torch, e.g. a
    view of the mapped file) for ``quant_gemm``; qtype: name or gguf GGMLQuantizationType.
    ValueError for an MXFP4 block whose scale is 0xFF (NaN in OCP MX).
    Repacked natively (cpud_quant_pack, on every thread) straight from raw's rows; memory: the
    packed result only.  alloc(shape, dtype) gives the result's two tensors, contiguous (e.g.
    ``HugeArena.take``); default: huge pages."""
    name = qtype_name(qtype)
    fmt = KERNEL_FORMATS[name]
    row_bytes = _row_bytes(name, n, k)
    arr = _u8(raw)
    if arr.dtype != np.uint8 or arr.size != n * row_bytes:
        raise _bad_rows("raw", n, row_bytes, [arr])
    b = None
    if bias is not None:
        if bias.shape != (n,) or not bias.is_floating_point():
            raise ValueError(f"bias: expected a float [{n}] tensor, got {tuple(bias.shape)}")
        b = bias.detach().to(torch.float32).contiguous()
    groups, nb = -(-n // ROWS), k // fmt.block_values
    new = alloc or (huge_empty if huge_pages else _plain_empty)
    qs, sc = new((groups, nb, fmt.qbytes), torch.uint8), new((groups, nb, fmt.sbytes), torch.uint8)
    pack_rows_into([[arr]], name, n, k, qs.unsqueeze(0), sc.unsqueeze(0))
    return QuantWeight(name, n, k, qs, sc, b)


def _flags(vnni: bool, amx: bool, amx_bf16: bool = True) -> int:
    return (0 if vnni else NO_VNNI) | (0 if amx else NO_AMX) | (0 if amx_bf16 else NO_AMX_BF16)


def _isa_code(isa: str | None) -> int:
    _require()
    name = _loader.default_isa() if isa is None else isa
    if name not in _loader.supported_isas():
        raise ValueError(
            f"ISA tier {name!r} cannot run here; supported: {_loader.supported_isas()}"
        )
    return _loader.ISAS.index(name)


def quant_gemm(
    x: torch.Tensor,
    packed: QuantWeight,
    out: torch.Tensor | None = None,
    isa: str | None = None,
    vnni: bool = True,
    amx: bool = True,
    amx_bf16: bool = True,
) -> torch.Tensor:
    """out [M, n] = x [M, k] @ W^T (+ bias) for W packed by ``pack_quantized``; x, out fp32
    or bf16 (out defaults to x's dtype), rows of any stride with dense columns.  isa: the tier
    (default ``cpud.native.isa()``); vnni=False keeps to vpmaddubsw where VNNI exists;
    amx=False keeps the amx tier to AVX512-VNNI; amx_bf16=False keeps it to the int8 kernels
    from ``bf16_tile_rows`` rows too."""
    code = _isa_code(isa)
    xdt, xs, out, odt, os_ = gemm_io(x, packed.n, packed.k, out)
    if packed.qs.data_ptr() % 64 or not packed.qs.is_contiguous():
        raise ValueError("packed.qs: must be contiguous and 64-byte aligned")
    bias = packed.bias
    rc = _loader.lib.cpud_quant_gemm(
        code,
        _flags(vnni, amx, amx_bf16),
        KERNEL_FORMATS[packed.qtype].code,
        x.data_ptr(),
        xdt,
        xs,
        packed.qs.data_ptr(),
        packed.sc.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        out.data_ptr(),
        odt,
        os_,
        x.shape[0],
        packed.n,
        packed.k,
    )
    check_rc(rc, f"quant_gemm {packed.qtype}")
    return out


def quant_linear(
    x: torch.Tensor,
    parts: list[QuantWeight],
    out: torch.Tensor | None = None,
    isa: str | None = None,
    vnni: bool = True,
    amx: bool = True,
    amx_bf16: bool = True,
) -> torch.Tensor:
    """out [M, sum of n] = x [M, k] @ the parts' W side by side (1 to 3 parts, types may
    differ, one k): equal bit for bit to ``quant_gemm`` per part into its columns, with x
    quantized once and, where the vector kernels run, one parallel region for every part."""
    if not 1 <= len(parts) <= 3 or len({p.k for p in parts}) != 1:
        raise ValueError(f"parts: 1 to 3 packed weights of one k, got {len(parts)}")
    for p in parts:
        if p.qs.data_ptr() % 64 or not p.qs.is_contiguous():
            raise ValueError("parts: qs must be contiguous and 64-byte aligned")
    code = _isa_code(isa)
    xdt, xs, out, odt, os_ = gemm_io(x, sum(p.n for p in parts), parts[0].k, out)
    q = _loader.ffi.new("cpud_qlinear *")
    q.parts = len(parts)
    for i, p in enumerate(parts):
        q.qtype[i], q.n[i] = KERNEL_FORMATS[p.qtype].code, p.n
        q.qs[i], q.sc[i] = p.qs.data_ptr(), p.sc.data_ptr()
        q.bias[i] = 0 if p.bias is None else p.bias.data_ptr()
    rc = _loader.lib.cpud_quant_linear(
        code, _flags(vnni, amx, amx_bf16), q, x.data_ptr(), xdt, xs, out.data_ptr(), odt, os_,
        x.shape[0], parts[0].k,
    )  # fmt: skip
    check_rc(rc, "quant_linear " + "+".join(p.qtype for p in parts))
    return out


def quant_kernel(
    isa: str | None = None, vnni: bool = True, amx: bool = True, amx_bf16: bool = True
) -> str:
    """Name of the kernel quant_gemm runs at this tier, e.g. "avx512 avx512-vnni", "amx
    amx-int8" (AMX-INT8 tiles from 16 rows of x, AVX512-VNNI below) or "amx amx-int8+bf16"
    (AMX-BF16 tiles on dequantized groups from ``bf16_tile_rows`` rows)."""
    name = _loader.lib.cpud_quant_kernel(_isa_code(isa), _flags(vnni, amx, amx_bf16))
    return _loader.ffi.string(name).decode()


def bf16_tile_rows(
    qtype: Any, isa: str | None = None, vnni: bool = True, amx: bool = True, amx_bf16: bool = True
) -> int | None:
    """Rows of x from which quant_gemm runs qtype on AMX-BF16 tiles (weights dequantized to
    bf16 per group, x rounded to bf16); None where that tier and flags never do."""
    code = KERNEL_FORMATS[qtype_name(qtype)].code
    rows = _loader.lib.cpud_quant_bf16_min_m(_isa_code(isa), _flags(vnni, amx, amx_bf16), code)
    check_rc(min(rows, 0), "bf16_tile_rows")
    return rows or None


def quant_compute_probe(
    iters: int, isa: str | None = None, vnni: bool = True, amx: bool = True
) -> float:
    """Int8 ops (2 per multiply-add) of iters rounds of independent dot instructions of that
    kernel on every thread (amx-int8: 16 x 16 x 64 tdpbssd tiles); timed by the caller, the
    int8 instruction peak."""
    if iters < 0:
        raise ValueError(f"iters must be >= 0, got {iters}")
    ops = float(_loader.lib.cpud_quant_compute_probe(_isa_code(isa), _flags(vnni, amx), iters))
    check_rc(0 if ops >= 0 else -1, "quant_compute_probe")
    return ops


__all__ = [
    "QTYPES",
    "QuantWeight",
    "bf16_tile_rows",
    "pack_quantized",
    "pack_rows_into",
    "qtype_name",
    "quant_compute_probe",
    "quant_gemm",
    "quant_kernel",
    "quant_linear",
]
