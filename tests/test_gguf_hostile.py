"""Hostile GGUF headers: declared counts and lengths larger than the file, arrays nested without
end, tensor offsets outside the data section, off its alignment or shared between tensors.
Each is a one-line ConfigError naming the file, raised in milliseconds with bounded memory,
before the gguf package's reader parses anything; a file that passes is read exactly as the
header says."""

from __future__ import annotations

import re
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from gguf_raw import (
    array,
    deadline,
    gguf_bytes,
    key_value,
    nested_array,
    patched,
    small_file,
    string,
    tensor_info,
    tensor_offset_positions,
    u32,
    u64,
)

from cpud.model.gguf_file import open_gguf
from cpud.model.gguf_header import MAX_ARRAY_DEPTH, MAX_METADATA_VALUES, check_gguf_file
from cpud.settings.errors import ConfigError

ARCH = key_value("general.architecture", V.STRING, string("llama"))


def write(tmp_path: Path, data: bytes, name: str = "hostile.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def refusal(path: Path) -> str:
    """open_gguf's ConfigError for path, raised within 1 s while holding under 1 MiB."""
    tracemalloc.start()
    try:
        with deadline(1.0), pytest.raises(ConfigError) as info:
            open_gguf(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated before the refusal"
    message = str(info.value)
    assert message.startswith(f"{path}") and "\n" not in message
    return message


def test_an_array_longer_than_the_file_is_refused_at_once(tmp_path):
    kvs = [ARCH, key_value("tokenizer.ggml.scores", V.ARRAY, array(V.UINT8, 1 << 60, b"abc"))]
    message = refusal(write(tmp_path, gguf_bytes(kvs)))
    assert f"declares {1 << 60} items of type UINT8" in message and "remain" in message


def test_a_string_longer_than_the_file_is_refused(tmp_path):
    kvs = [ARCH, key_value("general.name", V.STRING, u64((1 << 64) - 1) + b"x")]
    assert "metadata key general.name at byte" in refusal(write(tmp_path, gguf_bytes(kvs)))


def test_arrays_nested_50000_deep_are_refused(tmp_path):
    kvs = [ARCH, key_value("general.tags", V.ARRAY, nested_array(50_000))]
    message = refusal(write(tmp_path, gguf_bytes(kvs)))
    assert f"nests arrays more than {MAX_ARRAY_DEPTH} levels deep" in message


def test_arrays_nested_to_the_bound_are_read(tmp_path):
    kvs = [ARCH, key_value("general.tags", V.ARRAY, nested_array(MAX_ARRAY_DEPTH))]
    reader = open_gguf(write(tmp_path, gguf_bytes(kvs)))
    assert reader.fields["general.tags"].contents() == []
    deeper = [ARCH, key_value("general.tags", V.ARRAY, nested_array(MAX_ARRAY_DEPTH + 1))]
    refusal(write(tmp_path, gguf_bytes(deeper), "deeper.gguf"))


@pytest.mark.parametrize(
    ("offset", "expected"),
    [
        ((1 << 64) - 1, r"starts at offset 18446744073709551615 .* not a multiple of .* 32"),
        ((1 << 64) - 32, r"tensor t.f16 .* past the end of the file"),
        (33, r"t.f16 starts at offset 33 of the data section, which is not a multiple of"),
        (0, r"tensors t.f32 \(bytes 512-544\) and t.f16 \(from byte 512\) share bytes"),
        (64, r"tensors t.f16 \(bytes 576-704\) and t.q8 \(from byte 672\) share bytes"),
        (192, r"tensor t.f16 .* ends at byte 832, past the end"),
    ],
    ids=["max", "max-aligned", "off-alignment", "same-start", "overlap", "past-end"],
)
def test_tensor_offsets_are_checked(tmp_path, offset, expected):
    valid = write(tmp_path, small_file(), "valid.gguf")
    position = tensor_offset_positions(valid)["t.f16"]
    bad = write(tmp_path, patched(small_file(), position, u64(offset)))
    message = refusal(bad)
    assert re.search(expected, message), message


def test_tensor_offsets_of_a_model_file_are_checked(gguf_file, tmp_path):
    path = gguf_file("llama", T.Q8_0)
    reader = open_gguf(path)
    first, second, last = reader.tensors[0], reader.tensors[1], reader.tensors[-1]
    positions = tensor_offset_positions(path)
    data = path.read_bytes()
    shared = patched(data, positions[second.name], u64(first.data_offset - reader.data_offset))
    message = refusal(write(tmp_path, shared))
    assert f"and {second.name} (from byte {first.data_offset}) share bytes" in message
    off = patched(data, positions[last.name], u64(last.data_offset - reader.data_offset + 1))
    assert "not a multiple of the file's alignment 32" in refusal(write(tmp_path, off, "off.gguf"))


def _with_tensor(info: bytes, data: bytes = bytes(64)) -> bytes:
    return gguf_bytes([ARCH], [info], data)


HOSTILE = {
    "version 1": (
        b"GGUF" + u32(1) + u64(0) + u64(0),
        "GGUF version 1 (cpud reads versions 2 and 3)",
    ),
    "short header": (b"GGUF" + u32(3) + u64(0), "fewer than the 24 of a GGUF header"),
    "key count": (
        b"GGUF" + u32(3) + u64(0) + u64(1 << 62),
        f"declares {1 << 62} metadata keys",
    ),
    "tensor count": (
        b"GGUF" + u32(3) + u64(1 << 40) + u64(0),
        f"declares {1 << 40} tensors",
    ),
    "tensor table": (
        b"GGUF" + u32(3) + u64(1000) + u64(0) + bytes(100),
        "declares 1000 tensors, whose table needs at least 32000 bytes",
    ),
    "value type": (gguf_bytes([ARCH, key_value("x", 13, b"")]), "x has value type 13"),
    "item type": (
        gguf_bytes([ARCH, key_value("x", V.ARRAY, u32(99) + u64(0))]),
        "the items of metadata key x has value type 99",
    ),
    "key with a newline": (
        gguf_bytes([ARCH, key_value("a\nb", 13, b"")]),
        "metadata key 'a\\nb' has value type 13",
    ),
    "long tensor name": (
        _with_tensor(tensor_info("t" * 1000, (4,), 1000, 0)),
        f"tensor {'t' * 80!r}... has type 1000",
    ),
    "key twice": (gguf_bytes([ARCH, ARCH]), "metadata key general.architecture appears twice"),
    "key not utf-8": (
        gguf_bytes([ARCH, string(b"\xff\xfe") + u32(V.UINT8) + b"\x00"]),
        "the name of metadata key 1 at byte 77 is not UTF-8",
    ),
    "alignment type": (
        gguf_bytes([ARCH, key_value("general.alignment", V.UINT64, u64(32))]),
        "general.alignment is a UINT64, not a UINT32",
    ),
    "alignment value": (
        gguf_bytes([ARCH, key_value("general.alignment", V.UINT32, u32(48))]),
        "general.alignment is 48, not a power of two",
    ),
    "too many values": (
        gguf_bytes(
            [ARCH, key_value("x", V.ARRAY, array(V.BOOL, MAX_METADATA_VALUES, bytes(1 << 21)))]
        ),
        f"more than {MAX_METADATA_VALUES} values",
    ),
    "string items": (
        gguf_bytes([ARCH, key_value("x", V.ARRAY, array(V.STRING, 2, string("a") + u64(1 << 50)))]),
        "item 1 of metadata key x runs past the end of the file",
    ),
    "dims count": (_with_tensor(tensor_info("t", (1,) * 5, T.F32, 0)), "t has 5 dimensions"),
    "no dims": (_with_tensor(tensor_info("t", (), T.F32, 0) + bytes(8)), "t has 0 dimensions"),
    "zero dim": (_with_tensor(tensor_info("t", (4, 0), T.F32, 0)), r"dimensions [4, 0]"),
    "huge dims": (
        _with_tensor(tensor_info("t", (1 << 61, 1 << 61, 1 << 61, 1 << 61), T.F32, 0)),
        "tensor t (F32,",
    ),
    "tensor type": (
        _with_tensor(tensor_info("t", (4,), 1000, 0)),
        "t has type 1000, which GGML does not define",
    ),
    "partial block": (
        _with_tensor(tensor_info("t", (16,), T.Q8_0, 0)),
        "t (Q8_0) has rows of 16 values, not whole blocks of 32",
    ),
    "tensor twice": (
        gguf_bytes(
            [ARCH], [tensor_info("t", (8,), T.F32, 0), tensor_info("t", (8,), T.F32, 32)], bytes(64)
        ),
        "tensor t appears twice",
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_headers_are_refused_in_one_line(tmp_path, case):
    data, expected = HOSTILE[case]
    assert expected in refusal(write(tmp_path, data))


def test_the_checked_layout_is_what_the_reader_serves(gguf_file, tmp_path):
    for path in (write(tmp_path, small_file()), gguf_file("llama", T.Q8_0)):
        header = check_gguf_file(path)
        reader = open_gguf(path)
        assert header.data_offset == reader.data_offset
        assert list(header.keys) == [k for k in reader.fields if not k.startswith("GGUF.")]
        raw = np.fromfile(path, dtype=np.uint8)
        for span, tensor in zip(header.tensors, reader.tensors, strict=True):
            assert (span.name, span.type, span.start, span.n_bytes) == (
                tensor.name,
                tensor.tensor_type,
                tensor.data_offset,
                tensor.n_bytes,
            )
            assert tensor.data.view(np.uint8).tobytes() == raw[span.start : span.end].tobytes()


def test_truncation_at_every_byte_is_refused_or_reads_the_same(tmp_path):
    """The small file ends with 30 bytes of padding after its last tensor: cut there, it must
    read exactly as the whole file; cut anywhere else, it must be refused as truncated."""
    whole = small_file()
    original = open_gguf(write(tmp_path, whole, "whole.gguf"))
    last = original.tensors[-1]
    valid_from = last.data_offset + last.n_bytes
    for size in range(len(whole)):
        path = write(tmp_path, whole[:size])
        if size < valid_from:
            with deadline(1.0), pytest.raises(ConfigError, match="truncated"):
                open_gguf(path)
            continue
        reader = open_gguf(path)
        assert {k: f.contents() for k, f in reader.fields.items()} == {
            k: f.contents() for k, f in original.fields.items()
        }
        for got, want in zip(reader.tensors, original.tensors, strict=True):
            assert got.name == want.name and np.array_equal(got.data, want.data)


def _big_endian(offset: int) -> bytes:
    data = b"GGUF" + struct.pack(">IQQ", 3, 1, 1)
    data += struct.pack(">Q", 20) + b"general.architecture" + struct.pack(">IQ", V.STRING, 5)
    data += b"llama" + struct.pack(">Q", 1) + b"t" + struct.pack(">IQIQ", 1, 8, T.F32, offset)
    return data + bytes(-len(data) % 32) + np.arange(8, dtype=">f4").tobytes()


def test_big_endian_files_are_checked_in_their_byte_order(tmp_path):
    path = write(tmp_path, _big_endian(0))
    header = check_gguf_file(path)
    assert header.byte_order == ">" and header.tensors[0].n_bytes == 32
    assert open_gguf(path).tensors[0].data.tolist() == list(range(8))
    assert "t starts at offset 1 of the data section" in refusal(
        write(tmp_path, _big_endian(1), "off.gguf")
    )
