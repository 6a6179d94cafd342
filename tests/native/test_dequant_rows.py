"""Native dequantization of rows of a GGUF block table (dequant_rows.c): for every format, random
blocks (random bits, fp16 scales any finite value including subnormals) give gguf-py's
``gguf.quants.dequantize`` bit for bit in f32 (the C code runs the same f32 operations in the same
order) and its values rounded to nearest even in bf16; ids are bounds-checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from cpud import native
from cpud.native.dequant_rows import dequant_rows, dequant_rows_supported
from cpud.ranks.gguf_blocks import Blocks
from cpud.ranks.quant_compute import dequantize_rows

pytestmark = pytest.mark.skipif(
    not native.available(), reason=f"native kernels not built: {native.load_error()}"
)

# type: (values per block, bytes per block, byte offsets of its fp16 scales)
FORMATS = {
    T.Q8_0: (32, 34, (0,)),
    T.Q4_0: (32, 18, (0,)),
    T.Q4_1: (32, 20, (0, 2)),
    T.Q5_0: (32, 22, (0,)),
    T.Q5_1: (32, 24, (0, 2)),
    T.Q4_K: (256, 144, (0, 2)),
    T.Q5_K: (256, 176, (0, 2)),
    T.Q6_K: (256, 210, (208,)),
    T.MXFP4: (32, 17, ()),
}
ROWS = 7
IDS = [0, ROWS - 1, 3, 0, ROWS - 1, 5]


def random_table(qtype: T, rows: int, blocks: int, seed: int) -> np.ndarray:
    """[rows, blocks * block bytes] u8 of random blocks whose scales are finite."""
    _, size, halves = FORMATS[qtype]
    rng = np.random.default_rng(seed)
    table = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    for at in halves:
        bits = rng.integers(0, 0x10000, (rows, blocks), dtype=np.uint16)
        bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF  # an all-ones exponent (inf, NaN) -> finite
        table[:, :, at : at + 2] = bits[..., None].view(np.uint8)
    if qtype == T.MXFP4:
        # E8M0 exponents whose values stay finite (255 is NaN in OCP MX), and the two that
        # gguf-py turns into f32 subnormals
        table[:, :, 0] = np.minimum(table[:, :, 0], 250)
        table[0, 0, 0], table[rows - 1, 0, 0] = 0, 1
    return table.reshape(rows, -1)


def reference(table: np.ndarray, qtype: T, ids: list[int]) -> np.ndarray:
    return dequantize(np.ascontiguousarray(table[ids]), qtype).reshape(len(ids), -1)


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda t: t.name)
def test_rows_equal_gguf_py(qtype):
    values, _, _ = FORMATS[qtype]
    blocks = 3 if values == 32 else 2
    table = random_table(qtype, ROWS, blocks, seed=int(qtype))
    want = reference(table, qtype, IDS)
    ids = torch.tensor(IDS)

    assert dequant_rows_supported(qtype)
    got = dequant_rows(table, qtype, blocks * values, ids, torch.float32)
    assert got.shape == (len(IDS), blocks * values)
    np.testing.assert_array_equal(got.numpy().view(np.uint32), want.view(np.uint32))

    got_bf16 = dequant_rows(table, qtype, blocks * values, ids, torch.bfloat16)
    want_bf16 = torch.from_numpy(want).to(torch.bfloat16)
    assert torch.equal(got_bf16.view(torch.int16), want_bf16.view(torch.int16))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_0], ids=lambda t: t.name)
def test_column_range_of_a_wider_table(qtype):
    """A rank's column range is a strided view of the file's rows."""
    values, size, _ = FORMATS[qtype]
    wide = random_table(qtype, ROWS, 4, seed=99)
    part = wide[:, size : 3 * size]  # blocks 1 and 2 of every row
    want = reference(part, qtype, IDS)
    blocks = Blocks(qtype, part, (ROWS, 2 * values))
    got = dequantize_rows(blocks, torch.tensor(IDS), torch.float32)
    np.testing.assert_array_equal(got.numpy().view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("bad", [ROWS, -1])
def test_id_outside_the_table_is_refused(bad):
    table = random_table(T.Q8_0, ROWS, 1, seed=1)
    blocks = Blocks(T.Q8_0, table, (ROWS, 32))
    with pytest.raises(ValueError, match=f"ids must lie in \\[0, {ROWS}\\)"):
        dequantize_rows(blocks, torch.tensor([0, bad]), torch.float32)


def test_float_types_are_not_native_rows():
    assert not dequant_rows_supported(T.F32)
    assert not dequant_rows_supported(T.BF16)


@pytest.mark.parametrize(("arch", "qtype"), [("llama", T.Q4_0), ("qwen3", T.Q6_K)], ids=str)
def test_model_embedding_rows_equal_the_file(arch, qtype, gguf_file):
    """The loaded model's embedding, kept in its blocks, looks tokens up as gguf-py reads them."""
    from gguf import GGUFReader

    from cpud.model.load import load_model_config
    from cpud.ranks.layers.embedding import VocabParallelEmbedding
    from cpud.ranks.model_runner import ModelRunner, RunnerConfig
    from cpud.ranks.parallel import SingleRank

    path = gguf_file(arch, qtype)
    config = RunnerConfig(path, torch.float32, 512, 16, 32, kernels="native", kv_pretouch=False)
    run = ModelRunner(config, load_model_config(path), SingleRank())
    table = next(m for m in run.model.modules() if isinstance(m, VocabParallelEmbedding))
    assert table.row_blocks is not None and table.row_blocks.qtype == qtype

    embd = next(t for t in GGUFReader(path).tensors if t.name == "token_embd.weight")
    vocab = table.vocab_size
    tokens = [0, vocab - 1, 7, vocab // 2, 0]
    want = dequantize(np.asarray(embd.data)[tokens], qtype).reshape(len(tokens), -1)
    got = table(torch.tensor(tokens))
    np.testing.assert_array_equal(got.numpy().view(np.uint32), want.view(np.uint32))


def test_sizes_that_disagree_with_the_type_are_refused():
    table = random_table(T.Q4_K, ROWS, 1, seed=2)
    with pytest.raises(ValueError, match="invalid argument"):
        dequant_rows(table, T.Q4_K, 128, torch.tensor([0]), torch.float32)  # not 256 a block
    with pytest.raises(ValueError, match="invalid argument"):
        dequant_rows(table, T.Q4_K, 512, torch.tensor([0]), torch.float32)  # rows too short
