"""cpud's GGUF reader builds the metadata fields itself (cpud.model.gguf_fields, ~3x faster than
the gguf package on a large vocabulary): every field must come out as the package builds it,
values, types and item counts, for every value type, empty and nested arrays, real vocabularies
and files of the other byte order."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from gguf_raw import array, gguf_bytes, key_value, nested_array, small_file, string

from cpud.model.gguf_file import FastReader

SCALARS = {
    V.UINT8: "<B",
    V.INT8: "<b",
    V.UINT16: "<H",
    V.INT16: "<h",
    V.UINT32: "<I",
    V.INT32: "<i",
    V.FLOAT32: "<f",
    V.UINT64: "<Q",
    V.INT64: "<q",
    V.FLOAT64: "<d",
    V.BOOL: "<?",
}


def every_value_type() -> bytes:
    kvs = [key_value("general.architecture", V.STRING, string("llama"))]
    for kind, fmt in SCALARS.items():
        values = [1, 0, 1] if kind == V.BOOL else [3, 1, 2]
        if kind == V.FLOAT32:
            values = [0.1, -2.5, float("inf")]
        packed = b"".join(struct.pack(fmt, v) for v in values)
        kvs.append(key_value(f"s.{kind.name}", kind, struct.pack(fmt, values[0])))
        kvs.append(key_value(f"a.{kind.name}", V.ARRAY, array(kind, 3, packed)))
        kvs.append(key_value(f"e.{kind.name}", V.ARRAY, array(kind, 0)))
    words = ["", "a b", "naïve 東京 🚀", "x" * 300]
    kvs.append(key_value("a.STRING", V.ARRAY, array(V.STRING, 4, b"".join(map(string, words)))))
    kvs.append(key_value("e.STRING", V.ARRAY, array(V.STRING, 0)))
    kvs.append(key_value("n.ARRAY", V.ARRAY, nested_array(3)))
    two = array(V.UINT8, 2, b"\x01\x02") + array(V.UINT8, 1, b"\x03")
    kvs.append(key_value("n.ARRAY2", V.ARRAY, array(V.ARRAY, 2, two)))
    kvs.append(key_value("general.alignment", V.UINT32, struct.pack("<I", 64)))
    return gguf_bytes(kvs)


def same_fields(path) -> int:
    want, got = gguf.GGUFReader(path), FastReader(path)
    assert list(got.fields) == list(want.fields)
    for key, field in want.fields.items():
        mine = got.fields[key]
        assert mine.types == field.types, key
        assert mine.data == field.data, key
        assert mine.offset == field.offset, key
        assert mine.contents() == field.contents(), key
        if field.types[0] == V.ARRAY and field.data and field.types[-1] != V.ARRAY:
            for i in (0, len(field.data) - 1):
                assert mine.contents(i) == field.contents(i), key
    assert got.data_offset == want.data_offset and got.alignment == want.alignment
    assert len(got.tensors) == len(want.tensors)
    for mine, tensor in zip(got.tensors, want.tensors):
        assert (mine.name, mine.data_offset, mine.n_bytes) == (
            tensor.name,
            tensor.data_offset,
            tensor.n_bytes,
        )
        assert np.array_equal(mine.data, tensor.data, equal_nan=True)
    return len(want.fields)


def test_every_value_type_reads_as_the_package_reads_it(tmp_path):
    path = tmp_path / "types.gguf"
    path.write_bytes(every_value_type())
    assert same_fields(path) > 40
    small = tmp_path / "small.gguf"
    small.write_bytes(small_file())
    same_fields(small)


@pytest.mark.parametrize(("arch", "qtype"), [("qwen3", T.F32), ("llama", T.Q8_0)])
def test_a_vocabulary_reads_as_the_package_reads_it(gguf_file, arch, qtype):
    path = gguf_file(arch, qtype)
    assert "tokenizer.ggml.tokens" in gguf.GGUFReader(path).fields
    same_fields(path)


def test_a_big_endian_file_reads_as_the_package_reads_it(tmp_path):
    path = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
    writer.add_uint32("llama.block_count", 7)
    writer.add_array("tokenizer.ggml.tokens", ["a", "bc", "d"])
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0])
    writer.add_tensor("t", np.arange(8, dtype=np.float32).astype(">f4"), raw_dtype=T.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert FastReader(path).byte_order == "S"
    same_fields(path)


def test_a_value_past_the_end_is_an_error_not_a_short_read(tmp_path):
    data = every_value_type()
    cut = data.index(b"a.STRING") + 40
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:cut])
    with pytest.raises(ValueError, match="past the end of the file"):
        FastReader(path)
