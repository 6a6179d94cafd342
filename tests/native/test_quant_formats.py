"""The one table of GGUF formats (native/drivers/quant_formats.h): Python's parse of it agrees with
gguf's type ids and block sizes and with what the compiled kernels read from the same text;
packing follows it; a malformed table is refused at import with the line named."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from cpud.model.gguf_model import SUPPORTED_TYPES
from cpud.model.quant_check import BLOCKS, quantized_bytes
from cpud.native import _loader, quant
from cpud.native.quant_formats import (
    FLOAT_TYPES,
    FORMATS,
    KERNEL_FORMATS,
    TABLE,
    KernelFormat,
    parse_formats,
)

CPUD_EARG = -2


def test_table_lists_the_supported_types_with_ggufs_ids_and_sizes():
    assert SUPPORTED_TYPES == tuple(FORMATS)
    assert FLOAT_TYPES == {"F32", "F16", "BF16"}
    assert list(KERNEL_FORMATS) == ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4"]
    for name, fmt in FORMATS.items():
        gguf_type = GGMLQuantizationType[name]
        assert fmt.ggml_type == gguf_type.value, name
        assert (fmt.block_values, fmt.block_bytes) == GGML_QUANT_SIZES[gguf_type], name


def test_compiled_library_reads_the_same_table():
    ffi, lib = _loader.ffi, _loader.lib
    out = [ffi.new("int *") for _ in range(5)]
    for fmt in KERNEL_FORMATS.values():
        assert lib.cpud_quant_format(fmt.code, *out) == 0, fmt.name
        got = tuple(v[0] for v in out)
        want = (fmt.ggml_type, fmt.block_values, fmt.block_bytes, fmt.qbytes, fmt.sbytes)
        assert got == want, fmt.name
    for code in (-1, len(KERNEL_FORMATS)):
        assert lib.cpud_quant_format(code, *out) == CPUD_EARG
        assert lib.cpud_quant_bf16_min_m(0, 0, code) == -1


def test_python_views_follow_the_table():
    for name, fmt in KERNEL_FORMATS.items():
        want = (fmt.code, fmt.block_values, fmt.block_bytes, fmt.qbytes, fmt.sbytes)
        assert quant.QTYPES[name] == want
        assert BLOCKS[name] == (fmt.block_values, fmt.block_bytes)
    assert quantized_bytes(257, "Q4_K") == 2 * 144


@pytest.mark.parametrize("name", list(KERNEL_FORMATS))
def test_packing_has_the_tables_layout_on_plain_or_huge_pages(name):
    fmt = KERNEL_FORMATS[name]
    n, k = 20, 2 * fmt.block_values
    raw = np.random.default_rng(3).integers(0, 256, (n, k // fmt.block_values * fmt.block_bytes))
    raw = raw.astype(np.uint8)
    if name == "MXFP4":  # scale byte 0xFF is refused (tests/test_mxfp4.py)
        raw.reshape(n, -1, fmt.block_bytes)[..., 0] &= 0xFE
    plain = quant.pack_quantized(raw, name, n, k, huge_pages=False)
    huge = quant.pack_quantized(raw, name, n, k)
    assert plain.qs.shape == (2, 2, fmt.qbytes) and plain.sc.shape == (2, 2, fmt.sbytes)
    assert plain.gguf_bytes == raw.size
    assert torch.equal(plain.qs, huge.qs) and torch.equal(plain.sc, huge.sc)


def _table(*entries: str) -> str:
    return "/* a table */\n#define X(a, \\\n    b)\n" + "\n".join(entries) + "\n"


def test_parse_reads_every_kind_of_entry():
    formats = parse_formats(
        _table(
            "CPUD_FLOAT_FORMAT(F32, 0, 4)",
            "CPUD_DEQUANT_FORMAT(Q5_0, 6, 32, 22)",
            "CPUD_KERNEL_FORMAT(Q8_0, 8, 32, 34, 0, 512, 32, b32, 32, 0, 64)",
        )
    )
    assert [f.kind for f in formats.values()] == ["float", "dequant", "kernel"]
    q8 = formats["Q8_0"]
    assert isinstance(q8, KernelFormat) and (q8.code, q8.family, q8.mins) == (0, "b32", False)
    assert parse_formats(TABLE.read_text()) == FORMATS


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        (["CPUD_KERNEL_FORMAT(Q4_K, 12, 256, 144, 1, 2048, 320, k45, 32, 1, 64)"], "unbroken"),
        (["CPUD_FLOAT_FORMAT(F32, 0, 4)", "CPUD_FLOAT_FORMAT(F32, 1, 2)"], "name appears"),
        (["CPUD_KERNEL_FORMAT(Q8_0, 8, 32, 34, 0, 512, 32, b64, 32, 0, 64)"], "family"),
        (["CPUD_DEQUANT_FORMAT(Q5_0, 6, 32)"], "line 4"),
        (["CPUD_KERNEL_FORMAT(Q8_0, 8, 32, 34, 0, 512, 32,", "b32, 32, 0, 64)"], "line 4"),
    ],
)
def test_parse_refuses_a_malformed_table(entries, message):
    with pytest.raises(ValueError, match=message):
        parse_formats(_table(*entries))
