"""Read-only file mappings placed for 2 MiB pages: aligned, exact, unmapped with their buffer."""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch

from cpud.ranks import huge_file_map
from cpud.ranks.huge_file_map import HUGE, map_file_readonly, pmd_mapped_bytes, write_whole_pages


def mapped_ranges() -> list[tuple[int, str]]:
    with open("/proc/self/maps") as maps:
        return [(int(line.split("-")[0], 16), line.split()[1]) for line in maps]


@pytest.fixture
def data_file(tmp_path):
    payload = torch.randint(0, 256, (3 * HUGE + 12345,), dtype=torch.uint8)
    path = tmp_path / "weights.bin"
    path.write_bytes(payload.numpy().tobytes())
    return path, payload


def test_the_mapping_is_aligned_read_only_exact_and_released(data_file):
    path, payload = data_file
    with open(path, "rb") as f:
        mapping = map_file_readonly(f.fileno(), payload.numel())
    assert mapping.address % HUGE == 0
    assert (mapping.address, "r--s") in mapped_ranges()
    assert 0.0 <= mapping.huge_fraction <= 1.0
    assert pmd_mapped_bytes(mapping.address) == round(mapping.huge_fraction * mapping.size)
    tensor = torch.frombuffer(mapping.buffer, dtype=torch.uint8)
    assert torch.equal(tensor, payload)
    address, alive = mapping.address, weakref.ref(mapping.buffer)
    del mapping
    gc.collect()
    assert alive() is not None and pmd_mapped_bytes(address) is not None  # the tensor holds it
    del tensor
    gc.collect()
    assert alive() is None and pmd_mapped_bytes(address) is None


def test_small_pages_in_the_page_cache_are_dropped_and_read_again(data_file, monkeypatch):
    path, payload = data_file
    dropped = []
    monkeypatch.setattr(huge_file_map, "pmd_mapped_bytes", lambda address: 0)
    monkeypatch.setattr(os, "posix_fadvise", lambda *args: dropped.append(args[1:]))
    with open(path, "rb") as f:
        mapping = map_file_readonly(f.fileno(), payload.numel())
    assert mapping.reread and mapping.huge_fraction == 0.0
    assert dropped == [(0, 0, os.POSIX_FADV_DONTNEED)]
    assert torch.equal(torch.frombuffer(mapping.buffer, dtype=torch.uint8), payload)


def test_a_file_under_one_huge_page_is_never_read_twice(tmp_path, monkeypatch):
    path = tmp_path / "small.bin"
    path.write_bytes(b"x" * 5000)
    monkeypatch.setattr(huge_file_map, "pmd_mapped_bytes", lambda address: 0)
    with open(path, "rb") as f:
        mapping = map_file_readonly(f.fileno(), 5000)
    assert not mapping.reread and bytes(mapping.buffer) == b"x" * 5000


def test_mapping_an_unreadable_descriptor_raises_oserror(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY)  # a directory cannot be mapped
    try:
        with pytest.raises(OSError):
            map_file_readonly(fd, HUGE)
    finally:
        os.close(fd)


def test_an_unknown_address_has_no_mapping():
    assert pmd_mapped_bytes(HUGE) is None


def test_whole_page_writes_hold_the_pieces_and_zeros_between(tmp_path, monkeypatch):
    writes: list[tuple[int, int]] = []
    real_pwrite = os.pwrite

    def pwrite(fd: int, data, offset: int) -> int:
        writes.append((offset, len(data)))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(huge_file_map, "STAGING", 2 * HUGE)  # several flushes, and a long gap
    g = torch.Generator().manual_seed(5)
    pieces = [
        (0, bytes(range(256)) * 40),
        (HUGE - 5, torch.randint(0, 256, (3 * HUGE,), dtype=torch.uint8, generator=g).numpy()),
        (8 * HUGE + 100, b"tail"),
    ]
    size = 9 * HUGE
    path = tmp_path / "pieces.bin"
    with open(path, "wb") as f:
        write_whole_pages(f.fileno(), ((at, memoryview(data)) for at, data in pieces), size)
    expected = bytearray(size)
    for at, data in pieces:
        expected[at : at + len(data)] = bytes(data)
    assert path.read_bytes() == expected
    assert all(offset % HUGE == 0 and length % HUGE == 0 for offset, length in writes)
    assert sum(length for _, length in writes) == size


@pytest.mark.parametrize(
    "pieces, size",
    [
        ([(0, b"x")], HUGE + 1),  # not whole pages
        ([(0, b"abc"), (2, b"d")], HUGE),  # overlapping
        ([(HUGE - 1, b"ab")], HUGE),  # past the end
    ],
)
def test_whole_page_writes_refuse_a_bad_layout(tmp_path, pieces, size):
    with open(tmp_path / "bad.bin", "wb") as f, pytest.raises(ValueError):
        write_whole_pages(f.fileno(), ((at, memoryview(d)) for at, d in pieces), size)


def huge_share_when_read(path) -> float:
    """The share of the file mapped on 2 MiB pages once it is read afresh through a MADV_HUGEPAGE
    mapping: 0 where the file system caches it in small folios whatever is done (tmpfs without
    huge=), up to 1 where it reads it into 2 MiB folios (ext4 since Linux 6.16, xfs)."""
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        return map_file_readonly(f.fileno(), os.fstat(f.fileno()).st_size).huge_fraction


def test_a_file_written_in_whole_pages_maps_on_huge_pages_without_a_reread(tmp_path):
    payload = torch.randint(0, 256, (4 * HUGE,), dtype=torch.uint8)
    small = [(at, memoryview(payload.numpy()[at : at + 40960])) for at in range(0, 4 * HUGE, HUGE)]
    path = tmp_path / "written.bin"
    with open(path, "wb") as f:
        write_whole_pages(f.fileno(), small, 4 * HUGE)
        os.fsync(f.fileno())
    with open(path, "rb") as f:
        mapping = map_file_readonly(f.fileno(), 4 * HUGE)
    first = (mapping.huge_fraction, mapping.reread)
    assert bytes(mapping.buffer)[HUGE : HUGE + 40960] == bytes(small[1][1])
    del mapping
    gc.collect()
    best = huge_share_when_read(path)
    assert first == (best, False) if best else first[0] == 0.0
