"""MXFP4 (OCP microscaling FP4; GGUF type MXFP4 = 39) in its two storage layouts.

A block is 32 values: one E8M0 exponent byte e and 32 four-bit E2M1 codes; value i is
``E2M1_DOUBLED[code_i] * 2^(e - 128)`` (the E2M1 value doubled, so that the table holds
integers, against half the OCP scale 2^(e - 127); ggml's convention, which quant_gemm follows).

- GGUF: 17 bytes per block, e first, then byte j holding code j in its low nibble and code
  j + 16 in its high one.  A row of W[n, k] is k / 32 blocks one after another.
- Hugging Face (gpt-oss checkpoints): ``*_blocks`` uint8 [..., G, 16], byte j holding codes 2j
  (low nibble) and 2j + 1 (high), and ``*_scales`` uint8 [..., G], the same e.

``from_hf_blocks`` turns the second into the first (rows for ``pack_quantized``), ``to_hf_blocks``
back.  Exponent 0xFF is NaN in OCP MX; ggml reads it as 2^127; ``check_mxfp4_scales`` refuses
it.  numpy only (no torch, no compiled library).
"""

from __future__ import annotations

from typing import Any

import numpy as np

BLOCK_VALUES = 32
BLOCK_BYTES = 17
NAN_SCALE = 0xFF
E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
_ROWS_PER_PASS = 4096  # rows converted per numpy pass (bounds the temporaries)


def check_mxfp4_scales(scales: np.ndarray, what: str = "MXFP4 weights") -> None:
    """ValueError naming the first block whose E8M0 exponent is 0xFF (NaN in OCP MX): no value
    of such a block is a number, so the weights are damaged.  scales: [..., blocks per row]."""
    scales = np.asarray(scales)
    bad = scales == NAN_SCALE
    count = int(np.count_nonzero(bad))
    if count:
        where = np.unravel_index(int(np.argmax(bad)), scales.shape)
        row = ", ".join(str(int(i)) for i in where[:-1]) or "0"
        raise ValueError(
            f"{what}: {count} MXFP4 block(s) have scale byte 0xFF, NaN in OCP MX (first: row "
            f"{row}, block {int(where[-1])}); the file is damaged, convert it again"
        )


def _u8(name: str, a: Any) -> np.ndarray:
    arr = np.asarray(a)
    if arr.dtype != np.uint8:
        raise ValueError(f"{name}: expected uint8, got {arr.dtype}")
    return arr


def from_hf_blocks(blocks: Any, scales: Any) -> np.ndarray:
    """Hugging Face MXFP4 (blocks [..., G, 16] u8, scales [..., G] u8; numpy or CPU torch) ->
    GGUF MXFP4 rows [..., G * 17] u8: the same rows, each G blocks of k = 32 G values."""
    b, s = _u8("blocks", blocks), _u8("scales", scales)
    if b.ndim < 2 or b.shape[-1] != 16 or b.shape[:-1] != s.shape:
        raise ValueError(
            f"blocks [..., G, 16] and scales [..., G] expected, got {b.shape} and {s.shape}"
        )
    lead, g = b.shape[:-2], b.shape[-2]
    b, s = b.reshape(-1, g, 16), s.reshape(-1, g)
    out = np.empty((b.shape[0], g, BLOCK_BYTES), np.uint8)
    for r0 in range(0, b.shape[0], _ROWS_PER_PASS):
        part = b[r0 : r0 + _ROWS_PER_PASS]
        codes = np.stack([part & 0x0F, part >> 4], axis=-1).reshape(*part.shape[:-1], 32)
        out[r0 : r0 + _ROWS_PER_PASS, :, 0] = s[r0 : r0 + _ROWS_PER_PASS]
        out[r0 : r0 + _ROWS_PER_PASS, :, 1:] = codes[..., :16] | (codes[..., 16:] << 4)
    return out.reshape(*lead, g * BLOCK_BYTES)


def to_hf_blocks(rows: Any) -> tuple[np.ndarray, np.ndarray]:
    """GGUF MXFP4 rows [..., G * 17] u8 -> (blocks [..., G, 16], scales [..., G]) in the
    Hugging Face layout; ``from_hf_blocks`` undoes it."""
    r = _u8("rows", rows)
    if r.ndim < 1 or r.shape[-1] % BLOCK_BYTES:
        raise ValueError(f"rows: last dimension must be a multiple of 17, got {r.shape}")
    blk = r.reshape(*r.shape[:-1], -1, BLOCK_BYTES)
    codes = np.concatenate([blk[..., 1:] & 0x0F, blk[..., 1:] >> 4], axis=-1)  # value order
    pairs = codes.reshape(*codes.shape[:-1], 16, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4), np.ascontiguousarray(blk[..., 0])


__all__ = [
    "BLOCK_BYTES",
    "BLOCK_VALUES",
    "E2M1_DOUBLED",
    "check_mxfp4_scales",
    "from_hf_blocks",
    "to_hf_blocks",
]
