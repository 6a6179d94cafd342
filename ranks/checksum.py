"""CRC-32 of large buffers at memory speed.

zlib's crc32 reads ~3 GB/s on one core and releases the GIL on large inputs, so each buffer is
cut into PIECE-byte pieces, the pieces are summed on a few threads, and a buffer's checksum is
the CRC-32 of its pieces' CRC-32s (little-endian, in order). PIECE is part of what the value
means: changing it changes every checksum.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

PIECE = 8 << 20
MAX_THREADS = 8


def _threads() -> int:
    return max(1, min(MAX_THREADS, len(os.sched_getaffinity(0))))


def checksums(buffers: Sequence[memoryview], threads: int | None = None) -> list[int]:
    """One checksum per buffer (each a contiguous buffer of bytes), computed on up to `threads`
    threads (default: the CPUs this process may run on, at most MAX_THREADS)."""
    views = [memoryview(b).cast("B") for b in buffers]
    owners, pieces = [], []
    for owner, view in enumerate(views):
        for start in range(0, len(view), PIECE):
            owners.append(owner)
            pieces.append(view[start : start + PIECE])
    threads = threads or _threads()
    if threads == 1 or len(pieces) < 2:
        sums = [zlib.crc32(piece) for piece in pieces]
    else:
        with ThreadPoolExecutor(min(threads, len(pieces)), "cpud-crc") as pool:
            sums = list(pool.map(zlib.crc32, pieces))
    per_buffer: list[list[int]] = [[] for _ in views]
    for owner, value in zip(owners, sums):
        per_buffer[owner].append(value)
    return [zlib.crc32(struct.pack(f"<{len(s)}I", *s)) for s in per_buffer]
