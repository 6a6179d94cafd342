"""Read-only file mappings placed for 2 MiB pages: aligned, exact, unmapped with their buffer."""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch

from cpud.ranks import huge_file_map
from cpud.ranks.huge_file_map import HUGE, map_file_readonly, pmd_mapped_bytes


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
