"""A damaged weight cache is never served: every tensor's CRC-32 is checked when the file is
mapped, any change to the index or the data rebuilds the cache with one log line, and both
files reach the disk before they are renamed into place."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_weight_cache import greedy, load, mapped_files

from cpud import native
from cpud.ranks import checksum
from cpud.ranks.checksum import PIECE, checksums
from cpud.ranks.weight_cache import ALIGN, ShardIdentity, WeightCache


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "layers.0.qkv": torch.randn(96, 64, generator=g).to(torch.bfloat16),
        "layers.0.blocks": torch.randint(0, 256, (3000,), dtype=torch.uint8, generator=g),
        "lm_head": torch.randn(128, 40, generator=g).to(torch.bfloat16),
    }


TENSORS = _tensors()
SHAPES = {name: tuple(t.shape) for name, t in TENSORS.items()}
DTYPES = {name: t.dtype for name, t in TENSORS.items() if t.dtype != torch.bfloat16}


# Any directory without checkpoint files: the key stays the same wherever the cache is copied.
SHARD = ShardIdentity(str(Path(__file__).parent / "tools"), "torch.bfloat16", 1, 0, 16)


def _cache(root: Path) -> WeightCache:
    return WeightCache(root, SHARD)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pristine")
    _cache(root).store(TENSORS)
    return root


def _offsets(root: Path) -> list[int]:
    return [e["offset"] for e in json.loads(next(root.glob("*.json")).read_text())["tensors"]]


def _damage_bytes(data: bytearray, draw, offsets: list[int]) -> None:
    kind = draw(st.sampled_from(["flip", "overwrite", "at_each_tensor", "truncate", "extend"]))
    if kind == "flip":
        for _ in range(draw(st.integers(1, 4))):
            at = draw(st.integers(0, len(data) - 1))
            data[at] ^= draw(st.integers(1, 255))
    elif kind == "overwrite":
        at = draw(st.integers(0, len(data) - 1))
        junk = draw(st.binary(min_size=1, max_size=64))
        data[at : at + len(junk)] = junk[: len(data) - at]
    elif kind == "at_each_tensor":  # 1000 bytes at each tensor's offset, the size kept
        for at in (o for o in offsets if o < len(data)):
            junk = draw(st.binary(min_size=1000, max_size=1000))[: len(data) - at]
            data[at : at + len(junk)] = junk
    elif kind == "truncate":
        del data[draw(st.integers(0, len(data) - 1)) :]
    else:
        data.extend(draw(st.binary(min_size=1, max_size=16)))


@settings(
    max_examples=120,
    deadline=5000,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_any_damage_rebuilds_with_one_line_or_serves_the_stored_bytes(pristine, data, caplog):
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(shutil.copytree(pristine, Path(scratch) / "cache"))
        cache = _cache(root)
        target = data.draw(st.sampled_from([cache.data_path, cache.index_path]), label="file")
        raw = bytearray(target.read_bytes())
        _damage_bytes(raw, data.draw, _offsets(root))
        target.write_bytes(bytes(raw))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="cpud.ranks"):
            views = cache.load(SHAPES, DTYPES)
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        if views is None:
            assert len(warnings) == 1 and cache.key in warnings[0] and "rebuilding" in warnings[0]
            cache.store(TENSORS)  # what the rank does next: pack again and write
            views = cache.load(SHAPES, DTYPES)
            assert views is not None
        else:
            assert warnings == []
        assert views.keys() == TENSORS.keys()
        for name, tensor in TENSORS.items():
            assert torch.equal(views[name], tensor), name


def test_the_exact_damage_names_the_file_and_the_tensor(pristine, tmp_path, caplog):
    root = Path(shutil.copytree(pristine, tmp_path / "cache"))
    cache = _cache(root)
    size = cache.data_path.stat().st_size
    with open(cache.data_path, "r+b") as f:
        for offset in _offsets(root):
            f.seek(offset)
            f.write(b"\xff" * 1000)
    assert cache.data_path.stat().st_size == size
    with caplog.at_level(logging.WARNING, logger="cpud.ranks"):
        assert cache.load(SHAPES, DTYPES) is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert str(cache.data_path) in line and "tensor layers.0.qkv fails its checksum" in line


@pytest.mark.parametrize("which", ["data_path", "index_path"])
def test_a_fifo_in_place_of_a_cache_file_is_rebuilt_not_waited_on(
    pristine, tmp_path, which, caplog
):
    root = Path(shutil.copytree(pristine, tmp_path / "cache"))
    cache = _cache(root)
    getattr(cache, which).unlink()
    os.mkfifo(getattr(cache, which))
    with caplog.at_level(logging.WARNING, logger="cpud.ranks"):
        assert cache.load(SHAPES, DTYPES) is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert "FIFO" in line and "rebuilding" in line
    cache.store(TENSORS)
    views = cache.load(SHAPES, DTYPES)
    assert views is not None and all(torch.equal(views[n], t) for n, t in TENSORS.items())


def test_both_files_are_synced_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append(("replace", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    cache = _cache(tmp_path)
    cache.store(TENSORS)
    kinds = [kind for kind, _ in events]
    assert kinds == ["fsync", "replace", "fsync", "replace", "fsync"], events
    assert Path(events[0][1]).parent == tmp_path and events[1][1] == str(cache.data_path)
    assert Path(events[2][1]).parent == tmp_path and events[3][1] == str(cache.index_path)
    assert events[4][1] == str(tmp_path)


def test_checksums_do_not_depend_on_the_threads_and_see_one_byte():
    payload = bytearray(torch.randint(0, 256, (2 * PIECE + 12345,), dtype=torch.uint8).numpy())
    buffers = [memoryview(payload), memoryview(payload)[:100], memoryview(b"")]
    one = checksums(buffers, threads=1)
    assert checksums(buffers, threads=4) == one
    payload[PIECE + 7] ^= 1
    changed = checksums(buffers, threads=4)
    assert changed[0] != one[0] and changed[1:] == one[1:]
    assert checksum.MAX_THREADS >= 1


@pytest.mark.skipif(not native.available(), reason="native library not built")
def test_a_cache_overwritten_at_each_tensor_is_rebuilt_and_answers_as_before(
    model_factory, tmp_path, caplog
):
    model = Path(shutil.copytree(model_factory("qwen3"), tmp_path / "model"))
    cache = tmp_path / "cache"
    reference = greedy(load(model, cache))
    data = next(cache.glob("*.bin"))
    intact = data.read_bytes()
    offsets = _offsets(cache)
    assert all(o % ALIGN == 0 for o in offsets)
    with open(data, "r+b") as f:
        for offset in offsets:
            f.seek(offset)
            f.write(os.urandom(1000))
    assert data.stat().st_size == len(intact)
    with caplog.at_level(logging.WARNING, logger="cpud.ranks"):
        llm = load(model, cache)
    lines = [r.getMessage() for r in caplog.records if "weight cache" in r.getMessage()]
    assert len(lines) == 1 and str(data) in lines[0] and "fails its checksum" in lines[0]
    assert str(data) not in mapped_files()  # packed from the checkpoint, not the damaged file
    assert greedy(llm) == reference
    assert data.read_bytes() == intact  # written again, whole
    assert greedy(load(model, cache)) == reference
