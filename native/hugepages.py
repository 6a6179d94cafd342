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
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    start = (-raw.data_ptr()) % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes - nbytes % HUGE_PAGE or HUGE_PAGE)
    except OSError:
        pass  # THP off or not allowed: 4 KiB pages still work
    return raw[start : start + nbytes].view(dtype).view(shape)
