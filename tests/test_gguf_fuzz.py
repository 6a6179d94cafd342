"""GGUF headers and metadata fuzzed: generated headers with hostile counts, lengths, nesting,
value and tensor types and offsets; random byte flips in the header region of a small file and
of a model; every metadata key cpud reads set to a value of a random type. Each case, under a
deadline, is a one-line ConfigError naming the file or a file read exactly as its checked
header says, never a hang, a traceback or another exception. Then `cpud --model` on the
hostile files of the bug reports: exit 2 with one line on stderr."""

from __future__ import annotations

import itertools
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from gguf_raw import (
    ALIGNMENT,
    array,
    deadline,
    gguf_bytes,
    key_value,
    nested_array,
    patched,
    small_file,
    string,
    tensor_offset_positions,
    u32,
    u64,
    with_value,
)
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from cpud.model.gguf_file import field_value, open_gguf
from cpud.model.gguf_header import GGUFHeader, check_gguf_bytes, check_gguf_file
from cpud.settings.config import EngineArgs, resolve_config
from cpud.settings.errors import ConfigError

FUZZ = settings(
    max_examples=150,
    deadline=None,  # each case runs under its own SIGALRM deadline
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
INTERESTING = (
    0, 1, 2, 3, 7, 31, 32, 33, 255, 256, 1 << 16, (1 << 31) - 1, 1 << 31, (1 << 32) - 1,
    1 << 32, 1 << 60, (1 << 63) - 1, 1 << 63, (1 << 64) - 1,
)  # fmt: skip
SCALAR_SIZES = {
    V.UINT8: 1, V.INT8: 1, V.BOOL: 1, V.UINT16: 2, V.INT16: 2, V.UINT32: 4, V.INT32: 4,
    V.FLOAT32: 4, V.UINT64: 8, V.INT64: 8, V.FLOAT64: 8,
}  # fmt: skip
counts = st.one_of(st.integers(0, 4), st.sampled_from(INTERESTING))
value_types = st.one_of(st.sampled_from(list(V)), st.sampled_from([13, 255, (1 << 32) - 1]))
_names = itertools.count()


def one_line_refusal(error: ConfigError, path: Path) -> None:
    message = str(error)
    assert message.startswith(str(path)) and "\n" not in message, message


@st.composite
def values(draw: st.DrawFn, vtype: int, depth: int = 0) -> bytes:
    """A value of vtype, its declared lengths sometimes unlike what follows them."""
    if vtype in SCALAR_SIZES:
        return draw(st.binary(min_size=SCALAR_SIZES[vtype], max_size=SCALAR_SIZES[vtype]))
    if vtype == V.STRING:
        text = draw(st.binary(max_size=6))
        return u64(draw(st.one_of(st.just(len(text)), counts))) + text
    if vtype == V.ARRAY:
        item = draw(value_types if depth < 6 else st.sampled_from(list(SCALAR_SIZES)))
        items = draw(st.lists(values(item, depth + 1), max_size=3))
        declared = draw(st.one_of(st.just(len(items)), st.just(len(items)), counts))
        return u32(item) + u64(declared) + b"".join(items)
    return draw(st.binary(max_size=8))  # a type GGUF does not define


@st.composite
def key_values(draw: st.DrawFn) -> bytes:
    key = draw(
        st.one_of(
            st.sampled_from(["general.architecture", "a", "b", "tokenizer.ggml.tokens"]),
            st.text(max_size=6),
        )
    )
    choice = draw(st.integers(0, 9))
    if choice == 0:
        align = draw(st.sampled_from([0, 1, 2, 16, 32, 48, 64, 1 << 31]))
        return key_value("general.alignment", V.UINT32, u32(align))
    if choice == 1:
        return key_value(key, V.ARRAY, nested_array(draw(st.integers(1, 12))))
    vtype = draw(value_types)
    return key_value(key, vtype, draw(values(vtype)))


@st.composite
def tensor_infos(draw: st.DrawFn) -> bytes:
    name = draw(st.sampled_from(["t0", "t1", "t2"]))
    dims = draw(st.lists(st.one_of(st.sampled_from([1, 2, 4, 8, 32, 64]), counts), max_size=5))
    n_dims = draw(
        st.one_of(st.just(len(dims)), st.just(len(dims)), counts.map(lambda c: c % 2**32))
    )
    qtype = draw(
        st.one_of(
            st.sampled_from([T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_K]),
            st.sampled_from(list(T)),
            st.integers(0, (1 << 32) - 1),
        )
    )
    offset = draw(st.one_of(st.integers(0, 16).map(lambda k: k * ALIGNMENT), counts))
    return (
        string(name)
        + u32(n_dims)
        + b"".join(u64(d % 2**64) for d in dims)
        + u32(qtype)
        + u64(offset)
    )


@st.composite
def headers(draw: st.DrawFn) -> bytes:
    kvs = draw(st.lists(key_values(), max_size=5))
    infos = draw(st.lists(tensor_infos(), max_size=4))
    version = draw(st.one_of(st.just(3), st.just(2), st.sampled_from([0, 1, 4, 3 << 24])))
    n_tensors = draw(st.one_of(st.just(len(infos)), st.just(len(infos)), counts))
    n_keys = draw(st.one_of(st.just(len(kvs)), st.just(len(kvs)), counts))
    head = b"GGUF" + u32(version) + u64(n_tensors) + u64(n_keys) + b"".join(kvs + infos)
    data = head + bytes(-len(head) % ALIGNMENT) + draw(st.binary(max_size=600))
    cut = draw(st.one_of(st.just(len(data)), st.integers(0, len(data))))
    return data[:cut]


def agree(header: GGUFHeader, path: Path) -> None:
    """The reader serves what the checked header says: the same keys and tensor table, and each
    tensor's data is exactly its bytes of the file."""
    reader = open_gguf(path)
    raw = path.read_bytes()
    assert reader.data_offset == header.data_offset
    assert list(header.keys) == [k for k in reader.fields if not k.startswith("GGUF.")]
    for span, tensor in zip(header.tensors, reader.tensors, strict=True):
        assert (span.name, span.type, span.start, span.n_bytes) == (
            tensor.name,
            tensor.tensor_type,
            tensor.data_offset,
            tensor.n_bytes,
        )
        assert tuple(int(d) for d in tensor.shape) == span.dims
        assert tensor.data.view(np.uint8).tobytes() == raw[span.start : span.end]
    for key in header.keys:  # every value reads, or is refused as cpud reads it
        try:
            field_value(reader, key)
        except ConfigError as error:
            one_line_refusal(error, path)


def refused_or_read(data: bytes, folder: Path) -> bool:
    """True when the file is read as checked, False when it is refused in one line."""
    path = folder / f"case{next(_names)}.gguf"
    path.write_bytes(data)
    with deadline(2.0):
        try:
            header = check_gguf_bytes(data, str(path))
        except ConfigError as error:
            one_line_refusal(error, path)
            with pytest.raises(ConfigError):  # and the reader never sees it
                open_gguf(path)
            event("refused")
            return False
        agree(header, path)
    event("read")
    path.unlink()
    return True


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf-fuzz")


@FUZZ
@given(data=headers())
def test_generated_headers_are_refused_or_read_as_checked(folder, data):
    refused_or_read(data, folder)


def test_generated_headers_include_files_that_load(folder):
    """The generator reaches past the header checks: a fixed sample holds files that load."""
    loaded = []

    @settings(FUZZ, max_examples=60, derandomize=True)
    @given(data=headers())
    def run(data: bytes) -> None:
        loaded.append(refused_or_read(data, folder))

    run()
    assert any(loaded) and not all(loaded)


def flips(size: int, hot: tuple[int, int]) -> st.SearchStrategy[list[tuple[int, int]]]:
    """1-4 (position, xor) flips, positions anywhere below `size` or in the `hot` range."""
    position = st.one_of(st.integers(0, size - 1), st.integers(*hot), st.integers(0, 23))
    return st.lists(st.tuples(position, st.integers(1, 255)), min_size=1, max_size=4)


def flipped(data: bytes, changes: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for position, xor in changes:
        out[position] ^= xor
    return bytes(out)


SMALL = small_file()
SMALL_HEADER = check_gguf_bytes(SMALL, "small")
SMALL_TABLE = SMALL.index(string("t.f32"))


@FUZZ
@given(changes=flips(SMALL_HEADER.data_offset, (SMALL_TABLE, SMALL_HEADER.data_offset - 1)))
def test_byte_flips_in_a_small_header(folder, changes):
    refused_or_read(flipped(SMALL, changes), folder)


@pytest.fixture(scope="module")
def model(gguf_file) -> tuple[Path, bytes, GGUFHeader, int]:
    path = gguf_file("llama", T.Q8_0)
    header = check_gguf_file(path)
    table = min(tensor_offset_positions(path).values()) - 64
    return path, path.read_bytes(), header, table


def resolved_or_refused(data: bytes, folder: Path) -> None:
    """What `cpud --model` checks before any rank starts: a ConfigError in one line, or a
    config whose file reads as checked."""
    path = folder / f"model{next(_names)}.gguf"
    path.write_bytes(data)
    with deadline(5.0):
        try:
            resolve_config(EngineArgs(model=str(path)), path)
        except ConfigError as error:
            one_line_refusal(error, path)
            return
        agree(check_gguf_file(path), path)
    path.unlink()


def test_byte_flips_in_a_model_header(model, folder):
    path, data, header, table = model

    @settings(FUZZ, max_examples=80)
    @given(changes=flips(header.data_offset, (table, header.data_offset - 1)))
    def run(changes: list[tuple[int, int]]) -> None:
        resolved_or_refused(flipped(data, changes), folder)

    run()


READ_KEYS = (
    "general.architecture", "general.alignment", "split.count",
    "llama.block_count", "llama.context_length", "llama.embedding_length",
    "llama.feed_forward_length", "llama.attention.head_count", "llama.attention.head_count_kv",
    "llama.attention.key_length", "llama.attention.value_length",
    "llama.attention.layer_norm_rms_epsilon", "llama.rope.dimension_count",
    "llama.rope.freq_base", "llama.rope.scaling.type", "llama.rope.scaling.factor",
    "llama.rope.scale_linear", "llama.rope.scaling.original_context_length",
    "llama.rope.scaling.yarn_ext_factor", "llama.vocab_size", "llama.expert_count",
    "llama.expert_used_count", "tokenizer.ggml.model", "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores",
    "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id", "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix",
    "tokenizer.chat_template", "tokenizer.chat_templates",
)  # fmt: skip


@st.composite
def typed_values(draw: st.DrawFn) -> tuple[int, bytes]:
    """A well-formed value of a random type: scalars of any bits, text, arrays of those."""
    vtype = draw(st.sampled_from(list(V)))
    if vtype == V.STRING:
        return vtype, string(draw(st.text(max_size=12)).encode())
    if vtype == V.ARRAY:
        item = draw(st.sampled_from([t for t in V if t != V.ARRAY]))
        if item in SCALAR_SIZES:
            size = SCALAR_SIZES[item]
            items = draw(st.lists(st.binary(min_size=size, max_size=size), max_size=8))
            return vtype, array(item, len(items), b"".join(items))
        texts = draw(st.lists(st.text(max_size=6), max_size=6))
        return vtype, array(item, len(texts), b"".join(string(t.encode()) for t in texts))
    size = SCALAR_SIZES[vtype]
    small = st.integers(0, 3).map(lambda n: n.to_bytes(size, "little"))
    return vtype, draw(st.one_of(st.binary(min_size=size, max_size=size), small))


def test_metadata_values_of_any_type(model, folder):
    path = model[0]

    @settings(FUZZ, max_examples=80)
    @given(key=st.sampled_from(READ_KEYS), value=typed_values())
    def run(key: str, value: tuple[int, bytes]) -> None:
        resolved_or_refused(with_value(path, key, *value), folder)

    run()


ONE_OF_EACH_KIND = (
    (V.INT32, struct.pack("<i", (1 << 31) - 1)),
    (V.FLOAT32, struct.pack("<f", 0.5)),
    (V.BOOL, b"\x01"),
    (V.STRING, string("qwen2")),
    (V.ARRAY, array(V.STRING, 2, string("llama") + string("gpt2"))),
    (V.ARRAY, array(V.INT32, 2, struct.pack("<2i", 8, -1))),
)


def test_every_key_cpud_reads_with_a_value_of_each_kind(model, folder):
    """Each key cpud reads set to an integer, a float, a bool, a string, and arrays of strings
    and of integers: refused in one line or read, never another exception."""
    path = model[0]
    for key in READ_KEYS:
        for vtype, payload in ONE_OF_EACH_KIND:
            resolved_or_refused(with_value(path, key, vtype, payload), folder)


def _sharing_bytes(model: tuple[Path, bytes, GGUFHeader, int]) -> bytes:
    """blk.1.ffn_up.weight pointed at blk.0.ffn_up.weight's bytes (same type and shape)."""
    path, data, header, _ = model
    first = next(t for t in header.tensors if t.name == "blk.0.ffn_up.weight")
    position = tensor_offset_positions(path)["blk.1.ffn_up.weight"]
    return patched(data, position, u64(first.start - header.data_offset))


HOSTILE_FILES = {
    "array of 2^60 items": lambda model: gguf_bytes(
        [key_value("general.architecture", V.ARRAY, array(V.UINT8, 1 << 60, b"llama"))]
    ),
    "arrays nested 50000 deep": lambda model: gguf_bytes(
        [key_value("general.architecture", V.ARRAY, nested_array(50_000))]
    ),
    "offset 2^64-1": lambda model: patched(
        model[1], max(tensor_offset_positions(model[0]).values()), u64((1 << 64) - 1)
    ),
    "offset off alignment": lambda model: patched(
        model[1],
        max(tensor_offset_positions(model[0]).values()),
        struct.pack("<Q", model[2].tensors[-1].start - model[2].data_offset + 1),
    ),
    "tensors sharing bytes": _sharing_bytes,
}


@pytest.mark.parametrize("case", list(HOSTILE_FILES))
def test_cpud_refuses_hostile_files_in_one_line(model, tmp_path, case):
    path = tmp_path / "hostile.gguf"
    path.write_bytes(HOSTILE_FILES[case](model))
    result = subprocess.run(
        [sys.executable, "-m", "cpud.cli", "--model", str(path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith(f"cpud: error: {path}: "), result.stderr[-2000:]
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
