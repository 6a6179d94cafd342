"""The metadata fields of a GGUF file built as the gguf package's reader builds them, in a
fraction of its time.

The package's reader creates two numpy views per string (length and bytes) through several
calls each; a 49k-token vocabulary with its merges is ~200k strings, 0.65 s of CPU on every
start. Here each part is a memoryview of the same bytes (memoryviews have the `tolist()` and
`tobytes()` ReaderField.contents uses), read with struct in one loop: ~0.2 s. Strings, scalars
and arrays of those take this path; a field with nested arrays, and files of the other byte
order, go through the package's own code. Call it on files check_gguf_file has passed; a read
past the end is still a ValueError.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
from gguf import GGUFValueType
from gguf.gguf_reader import GGUFReader, ReaderField

_V = GGUFValueType
_FORMATS = {
    _V.UINT8: "B",
    _V.INT8: "b",
    _V.UINT16: "H",
    _V.INT16: "h",
    _V.UINT32: "I",
    _V.INT32: "i",
    _V.FLOAT32: "f",
    _V.UINT64: "Q",
    _V.INT64: "q",
    _V.FLOAT64: "d",
    _V.BOOL: "?",
}
_SIZES = {kind: struct.calcsize(fmt) for kind, fmt in _FORMATS.items()}
_U32 = struct.Struct("=I").unpack_from
_U64 = struct.Struct("=Q").unpack_from


class _Bytes:
    """The file's bytes as one memoryview; every read checked against the end."""

    def __init__(self, reader: GGUFReader):
        self.view = memoryview(reader.data.view(np.ndarray)).cast("B")
        self.size = len(self.view)

    def take(self, offset: int, n: int, fmt: str = "B") -> memoryview:
        if offset < 0 or n < 0 or offset + n > self.size:
            raise ValueError(f"{n} bytes at byte {offset} lie past the end of the file")
        part = self.view[offset : offset + n]
        return part if fmt == "B" else part.cast(fmt)

    def u32(self, offset: int) -> int:
        self.take(offset, 4)
        return _U32(self.view, offset)[0]

    def u64(self, offset: int) -> int:
        self.take(offset, 8)
        return _U64(self.view, offset)[0]


def _value(buf: _Bytes, offs: int, vtype: GGUFValueType, parts: list[Any]) -> tuple[int, int]:
    """Appends the parts of one string or scalar at offs; (its index in parts, bytes read)."""
    if vtype == _V.STRING:
        n = buf.u64(offs)
        parts.append(buf.take(offs, 8, "Q"))
        parts.append(buf.take(offs + 8, n))
        return len(parts) - 1, 8 + n
    size = _SIZES[vtype]
    parts.append(buf.take(offs, size, _FORMATS[vtype]))
    return len(parts) - 1, size


def _array(
    buf: _Bytes, offs: int, parts: list[Any], idxs: list[int], types: list[GGUFValueType]
) -> int | None:
    """Appends an array of strings or scalars; the bytes it takes, None for nested arrays."""
    item = GGUFValueType(buf.u32(offs))
    if item == _V.ARRAY:
        return None
    n = buf.u64(offs + 4)
    parts.append(buf.take(offs, 4, "I"))
    parts.append(buf.take(offs + 4, 8, "Q"))
    if n:  # the package takes the item type from the first item
        types.append(item)
    start = offs
    offs += 12
    if item == _V.STRING:
        for _ in range(n):
            index, size = _value(buf, offs, item, parts)
            idxs.append(index)
            offs += size
        return offs - start
    size, fmt = _SIZES[item], _FORMATS[item]
    whole = buf.take(offs, n * size)
    first = len(parts)
    parts.extend(whole[i : i + size].cast(fmt) for i in range(0, n * size, size))
    idxs.extend(range(first, first + n))
    return offs + n * size - start


def build_fields(reader: GGUFReader, offs: int, count: int) -> int:
    """GGUFReader._build_fields: `count` key-value fields from offs pushed into the reader;
    returns the offset after them."""
    if reader.byte_order != "I":  # the other byte order: the package's views swap it
        return GGUFReader._build_fields(reader, offs, count)
    buf = _Bytes(reader)
    for _ in range(count):
        start = offs
        n = buf.u64(offs)
        name = bytes(buf.take(offs + 8, n)).decode("utf-8")
        parts: list[Any] = [buf.take(offs, 8, "Q"), buf.take(offs + 8, n)]
        offs += 8 + n
        vtype = GGUFValueType(buf.u32(offs))
        parts.append(buf.take(offs, 4, "I"))
        offs += 4
        head = len(parts)
        types = [vtype]
        idxs: list[int] = []
        size: int | None
        if vtype == _V.ARRAY:
            size = _array(buf, offs, parts, idxs, types)
        else:
            index, size = _value(buf, offs, vtype, parts)
            idxs.append(index)
        if size is None:  # nested arrays: the package's own walk
            del parts[head:]
            size, more, more_idxs, types = reader._get_field_parts(offs, vtype)
            parts += more
            idxs = [i + head for i in more_idxs]
        reader._push_field(ReaderField(start, name, parts, idxs, types), skip_sum=True)
        offs += size
    return offs
