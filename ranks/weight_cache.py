"""Packed weights kept on disk between starts.

The first start of a rank reads its shard from the checkpoint and packs it for the native GEMM;
it then writes the packed tensors to one file in the cache directory. Later starts of the same
shard (same checkpoint files, dtype, TP degree and rank, same packed layout) map that file
instead: its pages come from the page cache without a copy, so start-up skips both the read
and the first touch of ~weights-sized fresh memory, which is most of the load time. The
mapping uses 2 MiB pages where the page cache holds 2 MiB folios (huge_file_map), so the
weights stream from it as fast as from anonymous huge pages. The tensors sit one after another
(64-byte aligned, as in a HugeArena) in a file of whole 2 MiB pages written a page at a time, so
the page cache holds it in 2 MiB folios right after the first start has written it.

Every tensor carries a CRC-32 (cpud.ranks.checksum) in the index, checked when the file is
mapped: a cache that is missing, stale or damaged is rebuilt, with one log line naming the file
(and the tensor whose bytes changed). Both files are synced to disk before they are renamed into
place. One that cannot be written (read-only or full disk) only costs the speed-up and says so
in the log.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from cpud.process.user_files import open_regular, read_text
from cpud.ranks.checksum import checksums
from cpud.ranks.huge_file_map import HUGE, map_file_readonly, write_whole_pages
from cpud.settings.errors import ConfigError

log = logging.getLogger("cpud.ranks")

# Bump when the packed layout or this file format changes: older files are then never read.
# 2: entries carry a dtype (uint8 for quantized parts); the identity names the quantization.
# 3: entries carry the CRC-32 of their bytes (cpud.ranks.checksum).
# 4: tensors packed 64-byte aligned (not one 2 MiB page each), the file whole 2 MiB pages.
FORMAT = 4
ALIGN = 64  # each tensor starts on a cache line of the file, as in a HugeArena
MAX_INDEX_BYTES = 64 << 20  # an index names a few hundred tensors: ~100 KB


def checkpoint_fingerprint(model_dir: Path) -> list[tuple[str, int, int]]:
    """(name, size, mtime_ns) of every file the weights and their shapes come from (a GGUF
    model is one file)."""
    if model_dir.is_file():
        files = [model_dir]
    else:
        files = sorted(model_dir.glob("*.safetensors")) + [model_dir / "config.json"]
    stats = [(f.name, f.stat()) for f in files if f.is_file()]
    return [(name, st.st_size, st.st_mtime_ns) for name, st in stats]


@dataclass(frozen=True)
class ShardIdentity:
    """What makes two ranks' packed shards byte-identical."""

    model_dir: str  # resolved path
    dtype: str
    tp_size: int
    tp_rank: int
    panel: int  # columns per packed panel (the native layout)
    quantization: str = ""  # "gguf" (the file's blocks), a --quantization type, or ""

    def key(self) -> str:
        from cpud import __version__

        fingerprint = checkpoint_fingerprint(Path(self.model_dir))
        text = json.dumps([FORMAT, __version__, self.__dict__, fingerprint], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:32]


class WeightCache:
    def __init__(self, root: Path, identity: ShardIdentity):
        self.root = root
        self.identity = identity
        self.key = identity.key()
        self.data_path = root / f"{self.key}.bin"
        self.index_path = root / f"{self.key}.json"

    def load(
        self,
        shapes: dict[str, tuple[int, ...]],
        dtypes: dict[str, torch.dtype] | None = None,
    ) -> dict[str, torch.Tensor] | None:
        """Read-only views of the cached tensors, one per name in `shapes` (those shapes, bf16
        unless `dtypes` names another), or None when there is no usable cache file."""
        dtypes = dtypes or {}
        wanted = {n: (tuple(s), str(dtypes.get(n, torch.bfloat16))) for n, s in shapes.items()}
        try:
            index = json.loads(read_text(self.index_path, MAX_INDEX_BYTES))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, RecursionError) as exc:
            log.warning("weight cache %s unreadable (%s): rebuilding it", self.index_path, exc)
            return None
        try:
            entries = {
                e["name"]: _Entry(
                    int(e["offset"]), tuple(e["shape"]), str(e["dtype"]), int(e["crc32"])
                )
                for e in index["tensors"]
            }
            total = int(index["bytes"])
        except (KeyError, TypeError, ValueError):
            log.warning("weight cache %s has a damaged index: rebuilding it", self.index_path)
            return None
        if {name: (e.shape, e.dtype) for name, e in entries.items()} != wanted or any(
            e.offset < 0 or e.offset % ALIGN or e.offset + e.nbytes > total
            for e in entries.values()
        ):
            log.warning("weight cache %s does not match this model: rebuilding it", self.key)
            return None
        try:
            with open_regular(self.data_path) as f:
                size = os.fstat(f.fileno()).st_size
                if size != total:
                    log.warning(
                        "weight cache %s is truncated or damaged (%d bytes, not %d): rebuilding it",
                        self.data_path,
                        size,
                        total,
                    )
                    return None
                # Read-only and shared: the tensors are the page cache's own pages (a private
                # writable mapping would be populated by copying every page), all mapped now
                # rather than on the first steps, on 2 MiB pages where the page cache allows.
                region = map_file_readonly(f.fileno(), size)
        except (OSError, ConfigError) as exc:
            log.warning("weight cache %s unreadable (%s): rebuilding it", self.data_path, exc)
            return None
        whole = memoryview(region.buffer).cast("B")
        found = checksums([whole[e.offset : e.offset + e.nbytes] for e in entries.values()])
        for (name, entry), crc in zip(entries.items(), found):
            if crc != entry.crc32:
                log.warning(
                    "weight cache %s is damaged (tensor %s fails its checksum): rebuilding it",
                    self.data_path,
                    name,
                )
                return None
        raw = torch.frombuffer(region.buffer, dtype=torch.uint8)
        views = {}
        for name, e in entries.items():
            chunk = raw[e.offset : e.offset + e.nbytes]
            views[name] = chunk.view(_DTYPES[e.dtype]).view(e.shape)
        log.info(
            "weight cache: packed weights mapped from %s, %.0f %% on 2 MiB pages%s",
            self.data_path,
            100 * region.huge_fraction,
            " (cached small pages dropped and read again)" if region.reread else "",
        )
        return views

    def store(self, tensors: dict[str, torch.Tensor]) -> None:
        """Write tensors (bf16 or uint8) as this shard's cache; failures only warn."""
        tmp = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._prune()
            data = {
                name: t.contiguous().view(torch.uint8).numpy().data.cast("B")
                for name, t in tensors.items()
            }
            offsets, total = _layout({name: view.nbytes for name, view in data.items()})
            sums = dict(zip(data, checksums(list(data.values()))))
            entries = [
                {
                    "name": name,
                    "offset": offsets[name],
                    "shape": list(tensor.shape),
                    "dtype": str(tensor.dtype),
                    "crc32": sums[name],
                }
                for name, tensor in tensors.items()
            ]
            fd, tmp = tempfile.mkstemp(prefix=f".{self.key}-", dir=self.root)
            with os.fdopen(fd, "wb") as f:
                write_whole_pages(f.fileno(), ((offsets[n], v) for n, v in data.items()), total)
                os.fsync(f.fileno())
            os.replace(tmp, self.data_path)
            tmp = None
            index = {"tensors": entries, "bytes": total, "shard": self.identity.__dict__}
            _write_atomic(self.index_path, json.dumps(index))
            _sync_directory(self.root)
            log.info("weight cache: wrote %s (%.2f GiB)", self.data_path, total / (1 << 30))
        except OSError as exc:
            log.warning(
                "weight cache: cannot write %s (%s); the next start packs the weights again "
                "(set --weight-cache to a writable directory, or off)",
                self.root,
                exc,
            )
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)

    def _prune(self) -> None:
        """Drop files of this shard built from other checkpoint versions, and of checkpoints
        that are gone."""
        for index_path in self.root.glob("*.json"):
            if index_path == self.index_path:
                continue
            try:
                shard = json.loads(read_text(index_path, MAX_INDEX_BYTES))["shard"]
            except (OSError, ValueError, KeyError):
                continue
            if shard == self.identity.__dict__ or not Path(shard.get("model_dir", "")).exists():
                index_path.unlink(missing_ok=True)
                index_path.with_suffix(".bin").unlink(missing_ok=True)


_DTYPES = {str(t): t for t in (torch.bfloat16, torch.uint8)}


def _layout(sizes: dict[str, int]) -> tuple[dict[str, int], int]:
    """Each tensor's offset (in order, ALIGN-aligned) and the file's size (whole 2 MiB pages:
    the last one, too, can then be cached in a 2 MiB folio)."""
    offsets, end = {}, 0
    for name, nbytes in sizes.items():
        offsets[name] = -(-end // ALIGN) * ALIGN
        end = offsets[name] + nbytes
    return offsets, -(-end // HUGE) * HUGE


@dataclass(frozen=True)
class _Entry:
    """One tensor of the index."""

    offset: int
    shape: tuple[int, ...]
    dtype: str
    crc32: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _DTYPES[self.dtype].itemsize


def _write_atomic(path: Path, text: str) -> None:
    """Replace `path` by a file holding `text`, synced to disk before the rename."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
        raise


def _sync_directory(path: Path) -> None:
    """Make the renames inside `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
