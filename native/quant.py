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

from collections.abc import Callable
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
_CHUNK_GROUPS = 64  # row groups repacked per numpy pass (bounds the scratch)


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


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] u8 -> [...] fp16 bits as uint16."""
    return np.ascontiguousarray(b).view(np.uint16)[..., 0]


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """[..., nbytes] u8 whose low nibbles hold values 0..run-1 of each 2*run and high nibbles
    the next run -> [..., 2 * nbytes] values."""
    q = qs.reshape(*qs.shape[:-1], -1, 1, run)
    return np.concatenate([q & 0x0F, q >> 4], axis=-2).reshape(*qs.shape[:-1], -1)


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., 12] packed 6-bit scales and mins -> ([..., 8], [..., 8]) u8."""
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([a & 63, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, mn


def _decode(name: str, blk: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """[rows, nb, type bytes] GGUF blocks -> (unsigned quants [rows, nb * bs], scale arrays
    [rows, nb, ...] in their packed order)."""
    rows = blk.shape[0]
    if name == "Q8_0":
        return (blk[..., 2:] ^ 0x80).reshape(rows, -1), [_f16(blk[..., 0:2])]
    if name == "MXFP4":
        return _nibbles(blk[..., 1:], 16).reshape(rows, -1), [blk[..., 0:1]]
    if name in ("Q4_0", "Q4_1"):
        off = 2 if name == "Q4_0" else 4
        scales = [_f16(blk[..., 0:2])] + ([_f16(blk[..., 2:4])] if name == "Q4_1" else [])
        return _nibbles(blk[..., off:], 16).reshape(rows, -1), scales
    if name in ("Q4_K", "Q5_K"):
        sc, mn = _scale_min_k4(blk[..., 4:16])
        q = _nibbles(blk[..., -128:].reshape(rows, -1, 4, 32), 32).reshape(rows, -1)
        if name == "Q5_K":
            qh = blk[..., 16:48][..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]
            q = q | ((qh & 1) << 4).reshape(rows, -1)
        return q, [_f16(blk[..., 0:2]), _f16(blk[..., 2:4]), sc, mn]
    ql = _nibbles(blk[..., 0:128].reshape(rows, -1, 2, 64), 64)
    qh = blk[..., 128:192].reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    q = (ql.reshape(rows, -1) | ((qh & 3) << 4).reshape(rows, -1)).astype(np.uint8)
    return q, [_f16(blk[..., 208:210]), blk[..., 192:208]]


def _dwords(q: np.ndarray) -> np.ndarray:
    """[g, 16, nb32, 32] values -> [g, nb32, 8, 16, 4]: dword t of every row (k = 4t + i)."""
    g, _, nb32, _ = q.shape
    return q.reshape(g, ROWS, nb32, 8, 4).transpose(0, 2, 3, 1, 4)


def _pack_quants(name: str, q: np.ndarray) -> np.ndarray:
    """[g, 16, k] unsigned quants -> [g, nb, qbytes]."""
    g, _, k = q.shape
    d = _dwords(q.reshape(g, ROWS, k // 32, 32))  # [g, nb32, t, r, i]
    if name == "Q8_0":
        return d.reshape(g, k // 32, -1)
    lo = (d & 0x0F).reshape(g, k // 32, 4, 2, ROWS, 4)
    parts = [lo[:, :, :, 0] | (lo[:, :, :, 1] << 4)]  # [g, nb32, chunk, r, i]
    hi = d >> 4
    if name == "Q5_K":
        parts.append(
            (hi << np.arange(8, dtype=np.uint8)[:, None, None]).sum(axis=2, dtype=np.uint8)[
                :, :, None
            ]
        )
    elif name == "Q6_K":
        h = (
            hi.reshape(g, k // 32, 2, 4, ROWS, 4)
            << (2 * np.arange(4, dtype=np.uint8))[:, None, None]
        )
        parts.append(h.sum(axis=3, dtype=np.uint8))
    return np.concatenate(parts, axis=2).reshape(g, k // KERNEL_FORMATS[name].block_values, -1)


def _pack_scales(name: str, scales: list[np.ndarray], g: int) -> np.ndarray:
    """Scale arrays [g * 16, nb, ...] -> [g, nb, sbytes], rows innermost."""
    out = []
    for s in scales:
        s = s.reshape(g, ROWS, s.shape[1], -1).transpose(0, 2, 3, 1)  # [g, nb, j, r]
        out.append(np.ascontiguousarray(s).view(np.uint8).reshape(g, s.shape[1], -1))
    return np.concatenate(out, axis=2)


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
    Works through 1024 rows at a time; memory: the packed result plus a few MB.  alloc(shape,
    dtype) gives the result's two tensors (e.g. ``HugeArena.take``); default: huge pages."""
    name = qtype_name(qtype)
    fmt = KERNEL_FORMATS[name]
    bs, tsize = fmt.block_values, fmt.block_bytes
    if n < 1 or k < 1 or k % bs:
        raise ValueError(f"{name}: k={k} must be a positive multiple of {bs} (n={n})")
    arr = raw.numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)
    if arr.dtype != np.uint8 or arr.size != n * k // bs * tsize:
        raise ValueError(
            f"raw: expected {n} x {k // bs * tsize} uint8, got {arr.dtype} {arr.shape}"
        )
    blocks = arr.reshape(n, k // bs, tsize)
    if name == "MXFP4":
        check_mxfp4_scales(blocks[..., 0])
    groups, nb = -(-n // ROWS), k // bs
    new = alloc or (huge_empty if huge_pages else _plain_empty)
    qs, sc = new((groups, nb, fmt.qbytes), torch.uint8), new((groups, nb, fmt.sbytes), torch.uint8)
    qs_np, sc_np = qs.numpy(), sc.numpy()
    for g0 in range(0, groups, _CHUNK_GROUPS):
        g1 = min(groups, g0 + _CHUNK_GROUPS)
        blk = np.zeros(((g1 - g0) * ROWS, nb, tsize), np.uint8)
        part = blocks[g0 * ROWS : g1 * ROWS]
        blk[: part.shape[0]] = part
        q, scales = _decode(name, blk)
        qs_np[g0:g1] = _pack_quants(name, q.reshape(g1 - g0, ROWS, k))
        sc_np[g0:g1] = _pack_scales(name, scales, g1 - g0)
    b = None
    if bias is not None:
        if bias.shape != (n,) or not bias.is_floating_point():
            raise ValueError(f"bias: expected a float [{n}] tensor, got {tuple(bias.shape)}")
        b = bias.detach().to(torch.float32).contiguous()
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
    "qtype_name",
    "quant_compute_probe",
    "quant_gemm",
    "quant_kernel",
    "quant_linear",
]
