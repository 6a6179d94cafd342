"""Tensors backed by transparent huge pages: weights streamed once per token touch 512x fewer
pages, so the decode GEMMs spend less on TLB misses and page walks."""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def huge_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor on 2 MiB-aligned anonymous memory advised MADV_HUGEPAGE (plain
    torch.empty below one huge page, or where madvise is refused). The memory is freed with the
    last tensor that views it; the calling thread's NUMA policy places it, as for torch."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE  # the tail's huge page too
    region = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    start = (-raw.data_ptr()) % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, span)
    except OSError:
        pass  # THP off or not allowed: 4 KiB pages still work
    return raw[start : start + nbytes].view(dtype).view(shape)


class HugeArena:
    """Tensors carved one after another, 64-byte aligned, from one region on transparent huge
    pages (``huge_empty``): small tensors (a layer's k and v projections) sit on huge pages too,
    and consecutive ones in the order they are taken.  Freed with the last tensor taken."""

    ALIGN = 64

    def __init__(self, nbytes: int) -> None:
        self._region = huge_empty((max(nbytes, 1),), torch.uint8)
        self._used = 0

    @staticmethod
    def _next(used: int, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int]:
        """(start, end) of the tensor taken after `used` bytes."""
        start = -(-used // HugeArena.ALIGN) * HugeArena.ALIGN
        return start, start + math.prod(shape) * dtype.itemsize

    @staticmethod
    def size_of(shapes: list[tuple[int, ...]], dtype: torch.dtype = torch.uint8) -> int:
        """Bytes an arena needs for tensors of these shapes taken in order."""
        total = 0
        for shape in shapes:
            total = HugeArena._next(total, shape, dtype)[1]
        return total

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor from the arena's next free bytes (64-byte aligned)."""
        start, end = self._next(self._used, shape, dtype)
        nbytes = end - start
        if end > self._region.numel():
            raise MemoryError(
                f"arena of {self._region.numel()} bytes has {self._region.numel() - start} "
                f"left, {nbytes} asked"
            )
        self._used = end
        return self._region[start:end].view(dtype).view(shape)
