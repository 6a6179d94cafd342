"""Packers for llama.cpp's K-quant blocks (Q4_K, Q5_K, Q6_K), which the gguf package can read
but not write: 256 values per super-block, a min/max search per sub-block, no error-minimizing
refinement (llama.cpp's make_qkx2 / make_qx search would be closer; these only need to be
valid blocks that gguf.quants.dequantize reads back)."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

QK_K = 256


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)


def _pack_6bit_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per block into 12 bytes, as Q4_K.get_scale_min unpacks them."""
    sc, mn = scales.astype(np.uint8), mins.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return out


def _affine(blocks: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Per 32-value sub-block: x ~ d * sc * q - dmin * m with q in [0, levels], sc and m 6-bit."""
    sub = blocks.reshape(blocks.shape[0], 8, 32)
    low = np.minimum(sub.min(axis=-1), 0.0)
    scale = (sub.max(axis=-1) - low) / levels
    offset = -low
    d = _f16(scale.max(axis=-1) / 63.0)
    dmin = _f16(offset.max(axis=-1) / 63.0)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 > 0)), 0, 63)
    m = np.clip(
        np.round(np.divide(offset, dmin32, out=np.zeros_like(offset), where=dmin32 > 0)), 0, 63
    )
    step = (d32 * sc)[..., None]
    shifted = sub + (dmin32 * m)[..., None]
    q = np.divide(shifted, step, out=np.zeros_like(shifted), where=step > 0)
    q = np.clip(np.round(q), 0, levels).astype(np.uint8)
    return d, dmin, sc, m, q


def _header(d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, m: np.ndarray) -> list[np.ndarray]:
    return [
        d.view(np.uint8).reshape(-1, 2),
        dmin.view(np.uint8).reshape(-1, 2),
        _pack_6bit_scales(sc, m),
    ]


def _low_nibbles(q: np.ndarray) -> np.ndarray:
    """Sub-blocks 2g and 2g+1 share 32 bytes: the low nibble holds 2g, the high one 2g+1."""
    pairs = (q & 0x0F).reshape(q.shape[0], 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(q.shape[0], 128)


def q4_k_blocks(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine(blocks, 15)
    return np.concatenate(_header(d, dmin, sc, m) + [_low_nibbles(q)], axis=1)


def q5_k_blocks(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine(blocks, 31)
    high = ((q >> 4) & 1).astype(np.uint8)  # [n, 8 sub-blocks, 32]: bit j of byte i is sub-block j
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for j in range(8):
        qh |= high[:, j] << j
    return np.concatenate(_header(d, dmin, sc, m) + [qh, _low_nibbles(q)], axis=1)


def q6_k_blocks(blocks: np.ndarray) -> np.ndarray:
    """x ~ d * scale * (q - 32) per 16-value sub-block, q in [0, 63], scale int8."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    amax = np.abs(sub).max(axis=-1)
    scale = amax / 31.0
    d = _f16(np.abs(scale).max(axis=-1) / 127.0)
    d32 = d.astype(np.float32)[:, None]
    sc = np.clip(
        np.round(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 > 0)), -128, 127
    )
    step = (d32 * sc)[..., None]
    q = np.divide(sub, step, out=np.zeros_like(sub), where=step > 0)
    q = (np.clip(np.round(q), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)
    # Value e = 128h + 64s + k (s in 0..1, k < 64): low 4 bits in ql[64h + k], nibble s.
    low = (q & 0x0F).reshape(n, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    # Value e = 128h + 32s + k (s in 0..3, k < 32): high 2 bits in qh[32h + k], bits 2s..2s+1.
    high = (q >> 4).reshape(n, 2, 4, 32)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    scales = sc.astype(np.int8).view(np.uint8)
    return np.concatenate([ql, qh.reshape(n, 64), scales, d.view(np.uint8).reshape(-1, 2)], axis=1)


PACKERS = {T.Q4_K: q4_k_blocks, T.Q5_K: q5_k_blocks, T.Q6_K: q6_k_blocks}


def quantize_k(values: np.ndarray, qtype: T) -> np.ndarray:
    """[rows, cols] float values (cols a multiple of 256) as [rows, bytes] of qtype blocks."""
    rows, cols = values.shape
    if cols % QK_K:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {QK_K} values, got {cols}")
    blocks = values.astype(np.float32).reshape(-1, QK_K)
    return PACKERS[qtype](blocks).reshape(rows, -1)
