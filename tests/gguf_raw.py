"""GGUF files byte by byte, for files the gguf package's writer will not write: hostile counts,
lengths, nesting, types and tensor offsets; and the byte positions of a written file's tensor
table, to patch a valid file (tests/gguf_writer.py) in place."""

from __future__ import annotations

import contextlib
import functools
import signal
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

from cpud.model.gguf_file import open_gguf

ALIGNMENT = 32


def u32(value: int) -> bytes:
    return struct.pack("<I", value)


def u64(value: int) -> bytes:
    return struct.pack("<Q", value)


def string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return u64(len(raw)) + raw


def array(item: V, count: int, items: bytes = b"") -> bytes:
    """An array value (item type, count, then `items` as given: they may be fewer than count)."""
    return u32(item) + u64(count) + items


def nested_array(depth: int) -> bytes:
    """An array holding an array holding ... `depth` levels, the innermost one empty."""
    inner = array(V.UINT8, 0)
    for _ in range(depth - 1):
        inner = array(V.ARRAY, 1, inner)
    return inner


def key_value(key: str, vtype: V, payload: bytes) -> bytes:
    return string(key) + u32(vtype) + payload


def tensor_info(name: str, dims: tuple[int, ...], qtype: int, offset: int) -> bytes:
    """GGUF order: dims[0] is the row length."""
    return string(name) + u32(len(dims)) + b"".join(u64(d) for d in dims) + u32(qtype) + u64(offset)


def gguf_bytes(
    kvs: list[bytes], infos: list[bytes] = (), data: bytes = b"", version: int = 3
) -> bytes:
    """Header, metadata, tensor table, padding to ALIGNMENT, then `data`."""
    head = b"GGUF" + u32(version) + u64(len(infos)) + u64(len(kvs)) + b"".join(kvs)
    head += b"".join(infos)
    return head + bytes(-len(head) % ALIGNMENT) + data


def small_file() -> bytes:
    """A small valid GGUF: a value of every type (an array of arrays among them) and three
    tensors of different types back to back, each padded to the alignment."""
    kvs = [
        key_value("general.architecture", V.STRING, string("llama")),
        key_value("a.u8", V.UINT8, b"\x07"),
        key_value("a.i16", V.INT16, struct.pack("<h", -3)),
        key_value("a.u32", V.UINT32, u32(70000)),
        key_value("a.f32", V.FLOAT32, struct.pack("<f", 0.5)),
        key_value("a.bool", V.BOOL, b"\x01"),
        key_value("a.u64", V.UINT64, u64(1 << 40)),
        key_value("a.f64", V.FLOAT64, struct.pack("<d", 2.25)),
        key_value("a.words", V.ARRAY, array(V.STRING, 3, string("x") + string("") + string("yz"))),
        key_value("a.ints", V.ARRAY, array(V.INT32, 3, struct.pack("<3i", 1, -2, 3))),
        key_value("a.nested", V.ARRAY, array(V.ARRAY, 1, array(V.UINT16, 2, b"\x01\x00\x02\x00"))),
    ]
    f32 = np.arange(8, dtype=np.float32).tobytes()  # 8 x F32 = 32 bytes
    f16 = np.arange(64, dtype=np.float16).tobytes()  # 16 x 4 F16 = 128 bytes
    q8 = bytes(range(34))  # one Q8_0 block: 32 values in 34 bytes
    infos = [
        tensor_info("t.f32", (8,), T.F32, 0),
        tensor_info("t.f16", (16, 4), T.F16, 32),
        tensor_info("t.q8", (32,), T.Q8_0, 160),
    ]
    return gguf_bytes(kvs, infos, f32 + f16 + q8 + bytes(-len(q8) % ALIGNMENT))


def tensor_offset_positions(path: Path) -> dict[str, int]:
    """Where each tensor's data offset (a u64 in the tensor table) lies in the file at path."""
    positions = {}
    for tensor in open_gguf(path).tensors:
        parts = tensor.field.parts  # name length, name, n_dims, dims, type, offset
        positions[tensor.name] = tensor.field.offset + sum(int(p.nbytes) for p in parts[:5])
    return positions


@functools.lru_cache(maxsize=8)
def _layout(path: Path, mtime_ns: int) -> tuple[int, dict[str, tuple[int, int]], int, int, int]:
    """Key count, each key's byte range, the tensor table's range and the data offset."""
    reader = open_gguf(path)

    def extent(field: Any) -> tuple[int, int]:
        return field.offset, field.offset + sum(int(p.nbytes) for p in field.parts)

    keys = {k: extent(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    table = [extent(t.field) for t in reader.tensors]
    end_of_keys = max(end for _, end in keys.values())
    table_start, table_end = (table[0][0], table[-1][1]) if table else (end_of_keys,) * 2
    return len(keys), keys, table_start, table_end, reader.data_offset


def with_value(path: Path, key: str, vtype: int, payload: bytes) -> bytes:
    """The file at path with metadata `key` set to (or, when absent, given) a value of type
    `vtype` encoded as `payload`, its tensor table and data moved to keep the data section
    aligned."""
    n_keys, keys, table_start, table_end, data_offset = _layout(path, path.stat().st_mtime_ns)
    data = path.read_bytes()
    if key in keys:
        start, end = keys[key]
    else:  # a new key, last of the metadata
        start = end = table_start
        n_keys += 1
    head = data[:16] + u64(n_keys) + data[24:start] + key_value(key, vtype, payload)
    head += data[end:table_end]
    return head + bytes(-len(head) % ALIGNMENT) + data[data_offset:]


def patched(data: bytes, position: int, value: bytes) -> bytes:
    return data[:position] + value + data[position + len(value) :]


class Overran(Exception):
    """A call took longer than its deadline."""


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise Overran in the calling (main) thread when the block runs past `seconds`."""

    def expire(signum: int, frame: object) -> None:
        raise Overran(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
