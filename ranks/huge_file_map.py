"""Map a file read-only so that its pages sit behind 2 MiB page-table entries where possible.

Decode streams every weight once per token. Through 4 KiB mappings the 1.1 GiB shard of
Qwen3-0.6B decoded 25-35 % slower than from anonymous huge pages here (19-24 vs 29-31 tok/s).
The kernel maps a file with one PMD entry per 2 MiB when the virtual address is 2 MiB-aligned
like the file offset and the page-cache folio there is itself 2 MiB. Readahead for a
MADV_HUGEPAGE mapping allocates such folios (filesystems with large folios: ext4, xfs, ...),
but pages already cached as small folios stay small. So: map at an aligned address, advise
MADV_HUGEPAGE, populate; when little of the file ends up PMD-mapped, drop its clean cached
pages (POSIX_FADV_DONTNEED) and populate once more, which re-reads the file at disk speed.

Buffered writes make folios as large as each write's aligned span allows (ext4 since Linux 6.16,
xfs), so a file written by write_whole_pages is cached in 2 MiB folios from the start and its
first mapping needs no re-read. Where the page cache keeps small folios whatever is done (tmpfs
without huge=, older kernels), the mapping still works, on 4 KiB pages.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

from cpud.ranks.libc import libc

HUGE = 2 << 20
PROT_NONE, PROT_READ = 0, 1
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
MADV_HUGEPAGE, MADV_POPULATE_READ = 14, 22
MAP_FAILED = ctypes.c_void_p(-1).value
RETRY_BELOW = 0.5  # PMD-mapped share under which the cached pages are dropped and re-read
STAGING = 16 * HUGE  # bytes gathered by write_whole_pages before each write


@dataclass
class FileMapping:
    """A read-only shared mapping; `buffer` exposes it (keep it alive as long as it is used:
    the mapping goes away with it)."""

    buffer: ctypes.Array
    address: int
    size: int
    huge_fraction: float  # share of the bytes mapped through 2 MiB entries
    reread: bool  # the cached pages were dropped and read again


def pmd_mapped_bytes(address: int) -> int | None:
    """FilePmdMapped of the mapping that starts at `address` (None: no such mapping)."""
    start = f"{address:x}-"
    found = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                if found:
                    return 0
                found = line.startswith(start)
            elif found and line.startswith("FilePmdMapped:"):
                return int(line.split()[1]) * 1024
    return 0 if found else None


def _map_once(fd: int, size: int) -> tuple[int, int, int]:
    """(reservation, its length, aligned address of the file's mapping); OSError on failure."""
    lib = libc()
    length = size + HUGE
    flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE
    reserve = lib.mmap(None, length, PROT_NONE, flags, -1, 0)
    if reserve in (None, MAP_FAILED):
        raise OSError(ctypes.get_errno(), "mmap (address reservation) failed")
    aligned = -(-reserve // HUGE) * HUGE
    got = lib.mmap(aligned, size, PROT_READ, MAP_SHARED | MAP_FIXED, fd, 0)
    if got != aligned:
        error = ctypes.get_errno()
        lib.munmap(reserve, length)
        raise OSError(error, "mmap of the file failed")
    lib.madvise(aligned, size, MADV_HUGEPAGE)  # refused (THP off): small pages, still correct
    lib.madvise(aligned, size, MADV_POPULATE_READ)  # refused before Linux 5.14: lazy faults
    return reserve, length, aligned


def map_file_readonly(fd: int, size: int) -> FileMapping:
    """Map the first `size` bytes of fd read-only and shared (see the module docstring)."""
    lib = libc()
    reserve, length, address = _map_once(fd, size)
    fraction = (pmd_mapped_bytes(address) or 0) / size
    reread = False
    if size >= HUGE and fraction < RETRY_BELOW:
        lib.munmap(reserve, length)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        reserve, length, address = _map_once(fd, size)
        fraction = (pmd_mapped_bytes(address) or 0) / size
        reread = True
    buffer = (ctypes.c_ubyte * size).from_address(address)
    weakref.finalize(buffer, lib.munmap, reserve, length)
    return FileMapping(buffer, address, size, fraction, reread)


def write_whole_pages(fd: int, pieces: Iterable[tuple[int, memoryview]], size: int) -> None:
    """Write a file of `size` bytes (a whole number of 2 MiB pages) holding each (offset, bytes)
    of `pieces` (by increasing offset, not overlapping) and zeros elsewhere, in writes of whole
    2 MiB pages at 2 MiB-aligned offsets (see the module docstring)."""
    if size % HUGE:
        raise ValueError(f"{size} bytes is not a whole number of {HUGE}-byte pages")
    writer = _PageWriter(fd, min(STAGING, size))
    for offset, data in pieces:
        data = memoryview(data).cast("B")
        if offset < writer.position or offset + len(data) > size:
            raise ValueError(f"a piece at {offset} overlaps the one before or passes the end")
        writer.put(offset, data)
    writer.pad_to(size)


class _PageWriter:
    """Gathers a file's bytes in a buffer of whole pages, written out each time it is full."""

    def __init__(self, fd: int, staging: int) -> None:
        self.fd = fd
        self.stage = memoryview(bytearray(staging))
        self.base = 0  # file offset of stage[0]
        self.filled = 0  # stage bytes set so far

    @property
    def position(self) -> int:
        return self.base + self.filled

    def put(self, offset: int, data: memoryview) -> None:
        while len(data):
            if offset >= self.base + len(self.stage):
                self._flush()
                continue
            at = offset - self.base
            self.stage[self.filled : at] = bytes(at - self.filled)
            n = min(len(data), len(self.stage) - at)
            self.stage[at : at + n] = data[:n]
            self.filled, offset, data = at + n, offset + n, data[n:]

    def pad_to(self, size: int) -> None:
        while self.base + len(self.stage) < size:
            self._flush()
        end = size - self.base
        self.stage[self.filled : end] = bytes(end - self.filled)
        self._write(self.stage[:end])

    def _flush(self) -> None:
        self.stage[self.filled :] = bytes(len(self.stage) - self.filled)
        self._write(self.stage)
        self.base += len(self.stage)
        self.filled = 0

    def _write(self, data: memoryview) -> None:
        done = 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], self.base + done)
