"""The layout of a GGUF file checked before anything parses it: every declared count and length
against the bytes left, array nesting and the number of metadata values bounded, and each
tensor's data inside the data section, aligned, the size its type and shape need, and apart from
every other tensor. One pass over the header that allocates nothing in proportion to what the
file declares; any defect is a one-line ConfigError naming the file."""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

from cpud.settings.errors import ConfigError

VERSIONS = (2, 3)
MAX_ARRAY_DEPTH = 4  # an array of arrays ... four levels at most (llama.cpp reads one)
MAX_METADATA_VALUES = 1 << 21  # keys plus array items; the largest vocabularies use under 1M
MAX_TENSORS = 1 << 16
MAX_DIMS = 4  # GGML_MAX_DIMS

_V = GGUFValueType
_SCALAR_SIZES = {
    _V.UINT8: 1,
    _V.INT8: 1,
    _V.BOOL: 1,
    _V.UINT16: 2,
    _V.INT16: 2,
    _V.UINT32: 4,
    _V.INT32: 4,
    _V.FLOAT32: 4,
    _V.UINT64: 8,
    _V.INT64: 8,
    _V.FLOAT64: 8,
}
# The fewest bytes one value of each type takes: a string is its length, an array its item type
# and count.
_MIN_SIZES = {**_SCALAR_SIZES, _V.STRING: 8, _V.ARRAY: 12}
_FIXED_PREFIX = 24  # magic, version, tensor count, key count
_MIN_KEY = 8 + 4 + 1  # key length, value type, the smallest value
_MIN_TENSOR_INFO = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dimension, type, offset


@dataclass(frozen=True)
class TensorSpan:
    name: str
    type: GGMLQuantizationType
    dims: tuple[int, ...]  # GGUF order: the row length first
    start: int  # absolute byte offset in the file
    n_bytes: int

    @property
    def end(self) -> int:
        return self.start + self.n_bytes


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    byte_order: str  # "<" or ">"
    alignment: int
    data_offset: int  # where the data section starts
    keys: tuple[str, ...]
    tensors: tuple[TensorSpan, ...]  # in the order the file lists them


def shown(name: str, limit: int = 80) -> str:
    """A name from a file as an error message shows it: as it is when printable and short,
    else quoted with escapes and cut, so that the message stays one short line."""
    if name.isprintable() and 0 < len(name) <= limit and name.strip() == name:
        return name
    return repr(name[:limit]) + ("..." if len(name) > limit else "")


class _Cursor:
    """Reads forward through the header; a read that would pass the end is a ConfigError."""

    def __init__(self, buf: bytes | mmap.mmap, order: str, source: str):
        self.buf, self.source, self.pos, self.size = buf, source, 0, len(buf)
        self._u32 = struct.Struct(order + "I")
        self._u64 = struct.Struct(order + "Q")

    @property
    def left(self) -> int:
        return self.size - self.pos

    def error(self, what: str) -> ConfigError:
        return ConfigError(
            f"{self.source}: {what}; the file is truncated or damaged: download or convert it again"
        )

    def skip(self, n: int, what: str) -> int:
        if n > self.size - self.pos:
            raise self.error(
                f"{what} at byte {self.pos} needs {n} bytes, {self.size - self.pos} remain"
            )
        start = self.pos
        self.pos += n
        return start

    def u32(self, what: str) -> int:
        return self._u32.unpack_from(self.buf, self.skip(4, what))[0]

    def u64(self, what: str) -> int:
        return self._u64.unpack_from(self.buf, self.skip(8, what))[0]

    def u32_at(self, position: int) -> int:
        """The u32 at an offset already read past."""
        return self._u32.unpack_from(self.buf, position)[0]

    def text(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        start = self.skip(n, what)
        try:
            return bytes(self.buf[start : start + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.error(f"{what} at byte {start} is not UTF-8") from None

    def skip_strings(self, count: int, what: str) -> None:
        """`count` strings back to back, read for their lengths only."""
        unpack, buf, size, pos = self._u64.unpack_from, self.buf, self.size, self.pos
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.skip(8, f"the length of item {i} of {what}")
            pos += 8 + unpack(buf, pos)[0]
            if pos > size:
                raise self.error(f"item {i} of {what} runs past the end of the file ({size} bytes)")
        self.pos = pos


class _Walk:
    """The metadata section: value types, lengths and nesting, and the values counted."""

    def __init__(self, cur: _Cursor):
        self.cur = cur
        self.values = 0

    def count(self, n: int, what: str) -> None:
        self.values += n
        if self.values > MAX_METADATA_VALUES:
            raise self.cur.error(
                f"{what} brings the metadata to more than {MAX_METADATA_VALUES} values "
                f"(keys plus array items), more than any model's vocabulary needs"
            )

    def value_type(self, what: str) -> GGUFValueType:
        raw = self.cur.u32(f"the value type of {what}")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.cur.error(
                f"{what} has value type {raw}, which GGUF does not define"
            ) from None

    def value(self, vtype: GGUFValueType, what: str, depth: int = 0) -> None:
        cur = self.cur
        size = _SCALAR_SIZES.get(vtype)
        if size is not None:
            cur.skip(size, what)
        elif vtype == _V.STRING:
            cur.skip(cur.u64(f"the length of {what}"), what)
        else:
            self.array(what, depth + 1)

    def array(self, what: str, depth: int) -> None:
        cur = self.cur
        if depth > MAX_ARRAY_DEPTH:
            raise cur.error(f"{what} nests arrays more than {MAX_ARRAY_DEPTH} levels deep")
        item = self.value_type(f"the items of {what}")
        n = cur.u64(f"the length of {what}")
        need = n * _MIN_SIZES[item]
        if need > cur.left:
            raise cur.error(
                f"{what} declares {n} items of type {item.name}, which "
                f"need at least {need} bytes, but {cur.left} remain"
            )
        self.count(n, what)
        size = _SCALAR_SIZES.get(item)
        if size is not None:
            cur.skip(n * size, what)
        elif item == _V.STRING:
            cur.skip_strings(n, what)
        else:
            for _ in range(n):
                self.array(what, depth + 1)


def _alignment(cur: _Cursor, vtype: GGUFValueType, at: int) -> int:
    if vtype != _V.UINT32:
        raise cur.error(f"general.alignment is a {vtype.name}, not a UINT32")
    value = cur.u32_at(at)
    if value == 0 or value & (value - 1):
        raise cur.error(f"general.alignment is {value}, not a power of two")
    return value


def _metadata(cur: _Cursor, n_keys: int) -> tuple[tuple[str, ...], int]:
    walk = _Walk(cur)
    walk.count(n_keys, f"the key count {n_keys}")
    keys: dict[str, None] = {}
    alignment = GGUF_DEFAULT_ALIGNMENT
    for i in range(n_keys):
        key = cur.text(f"the name of metadata key {i}")
        label = f"metadata key {shown(key)}"
        if key in keys:
            raise cur.error(f"{label} appears twice")
        keys[key] = None
        vtype = walk.value_type(label)
        at = cur.pos
        walk.value(vtype, label)
        if key == "general.alignment":
            alignment = _alignment(cur, vtype, at)
    return tuple(keys), alignment


def _tensor_info(cur: _Cursor, index: int, alignment: int, names: set[str]) -> TensorSpan:
    name = cur.text(f"the name of tensor {index}")
    label = shown(name)
    if name in names:
        raise cur.error(f"tensor {label} appears twice")
    names.add(name)
    n_dims = cur.u32(f"the dimension count of tensor {label}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.error(f"tensor {label} has {n_dims} dimensions (GGUF allows 1 to {MAX_DIMS})")
    dims = tuple(cur.u64(f"dimension {d} of tensor {label}") for d in range(n_dims))
    raw_type = cur.u32(f"the type of tensor {label}")
    offset = cur.u64(f"the data offset of tensor {label}")
    if not all(0 < d < 1 << 62 for d in dims):
        raise cur.error(f"tensor {label} has dimensions {list(dims)}: each must be positive")
    try:
        qtype = GGMLQuantizationType(raw_type)
    except ValueError:
        raise cur.error(f"tensor {label} has type {raw_type}, which GGML does not define") from None
    block, type_size = GGML_QUANT_SIZES[qtype]
    if dims[0] % block:
        raise cur.error(
            f"tensor {label} ({qtype.name}) has rows of {dims[0]} values, not whole blocks of "
            f"{block}"
        )
    if offset % alignment:
        raise cur.error(
            f"tensor {label} starts at offset {offset} of the data section, which is not a "
            f"multiple of the file's alignment {alignment}"
        )
    n_values = 1
    for d in dims:
        n_values *= d
    return TensorSpan(name, qtype, dims, offset, n_values // block * type_size)


def _place(cur: _Cursor, spans: list[TensorSpan], data_offset: int) -> tuple[TensorSpan, ...]:
    """The spans at their absolute offsets, each inside the file and none overlapping."""
    placed = tuple(
        TensorSpan(s.name, s.type, s.dims, data_offset + s.start, s.n_bytes) for s in spans
    )
    for span in placed:
        if span.end > cur.size:
            raise cur.error(
                f"tensor {shown(span.name)} ({span.type.name}, {span.n_bytes} bytes "
                f"at offset {span.start - data_offset} of the data section) ends at byte "
                f"{span.end}, past the end of the file ({cur.size} bytes)"
            )
    ordered = sorted(placed, key=lambda s: s.start)
    for before, after in zip(ordered, ordered[1:]):
        if after.start < before.end:
            raise cur.error(
                f"tensors {shown(before.name)} (bytes {before.start}-{before.end}) and "
                f"{shown(after.name)} "
                f"(from byte {after.start}) share bytes of the data section"
            )
    return placed


def check_gguf_bytes(buf: bytes | mmap.mmap, source: str) -> GGUFHeader:
    """The checked layout of the GGUF file whose bytes are `buf`; ConfigError naming `source`
    when the header or the tensor table is damaged or hostile."""
    if len(buf) < _FIXED_PREFIX:
        raise ConfigError(
            f"{source}: the file has {len(buf)} bytes, fewer than the {_FIXED_PREFIX} of a GGUF "
            f"header: it is truncated"
        )
    if bytes(buf[:4]) != b"GGUF":
        raise ConfigError(f"{source} is not a GGUF file: it starts with {bytes(buf[:4])!r}")
    order = "<"
    version = struct.unpack_from("<I", buf, 4)[0]
    if version & 0xFFFF == 0:  # a file written for the other byte order
        order = ">"
        version = struct.unpack_from(">I", buf, 4)[0]
    cur = _Cursor(buf, order, source)
    if version not in VERSIONS:
        raise cur.error(f"GGUF version {version} (cpud reads versions 2 and 3)")
    cur.skip(8, "magic and version")
    n_tensors = cur.u64("the tensor count")
    n_keys = cur.u64("the metadata key count")
    if n_keys * _MIN_KEY > cur.left:
        raise cur.error(
            f"it declares {n_keys} metadata keys, which need at least "
            f"{n_keys * _MIN_KEY} bytes, but {cur.left} remain"
        )
    if n_tensors > MAX_TENSORS:
        raise cur.error(f"it declares {n_tensors} tensors (cpud reads at most {MAX_TENSORS})")
    keys, alignment = _metadata(cur, n_keys)
    if n_tensors * _MIN_TENSOR_INFO > cur.left:
        raise cur.error(
            f"it declares {n_tensors} tensors, whose table needs at "
            f"least {n_tensors * _MIN_TENSOR_INFO} bytes, but {cur.left} remain"
        )
    names: set[str] = set()
    spans = [_tensor_info(cur, i, alignment, names) for i in range(n_tensors)]
    data_offset = -(-cur.pos // alignment) * alignment
    tensors = _place(cur, spans, data_offset)
    return GGUFHeader(version, order, alignment, data_offset, keys, tensors)


def check_gguf_file(path: str | os.PathLike) -> GGUFHeader:
    """check_gguf_bytes over the file, memory mapped (OSError when it cannot be read)."""
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < _FIXED_PREFIX:
            return check_gguf_bytes(f.read(), str(path))
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return check_gguf_bytes(mapped, str(path))
