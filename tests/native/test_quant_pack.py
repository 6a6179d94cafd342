"""cpud_quant_pack (pack_quantized's native repack) against a numpy reference of the packed
layout, byte for byte, for every kernel format: padding rows, one and many blocks, strided and
read-only views of the file's rows, expert stacks, and the argument errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpud.native import _loader, quant
from cpud.native.moe_kernels import quant_stack
from cpud.native.quant_formats import KERNEL_FORMATS

ROWS = quant.ROWS
FORMATS = list(KERNEL_FORMATS)


# --- numpy reference: the packed layout written out with reshapes and transposes ------------


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] u8 -> [...] fp16 bits as uint16."""
    return np.ascontiguousarray(b).view(np.uint16)[..., 0]


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """[..., nbytes] u8 whose low nibbles hold values 0..run-1 of each 2*run and high nibbles
    the next run -> [..., 2 * nbytes] values."""
    q = qs.reshape(*qs.shape[:-1], -1, 1, run)
    return np.concatenate([q & 0x0F, q >> 4], axis=-2).reshape(*qs.shape[:-1], -1)


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., 12] packed 6-bit scales and mins -> ([..., 8], [..., 8]) u8."""
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([a & 63, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, mn


def _decode(name: str, blk: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """[rows, nb, type bytes] GGUF blocks -> (unsigned quants [rows, nb * bs], scale arrays
    [rows, nb, ...] in their packed order)."""
    rows = blk.shape[0]
    if name == "Q8_0":
        return (blk[..., 2:] ^ 0x80).reshape(rows, -1), [_f16(blk[..., 0:2])]
    if name == "MXFP4":
        return _nibbles(blk[..., 1:], 16).reshape(rows, -1), [blk[..., 0:1]]
    if name in ("Q4_0", "Q4_1"):
        off = 2 if name == "Q4_0" else 4
        scales = [_f16(blk[..., 0:2])] + ([_f16(blk[..., 2:4])] if name == "Q4_1" else [])
        return _nibbles(blk[..., off:], 16).reshape(rows, -1), scales
    if name in ("Q4_K", "Q5_K"):
        sc, mn = _scale_min_k4(blk[..., 4:16])
        q = _nibbles(blk[..., -128:].reshape(rows, -1, 4, 32), 32).reshape(rows, -1)
        if name == "Q5_K":
            qh = blk[..., 16:48][..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]
            q = q | ((qh & 1) << 4).reshape(rows, -1)
        return q, [_f16(blk[..., 0:2]), _f16(blk[..., 2:4]), sc, mn]
    ql = _nibbles(blk[..., 0:128].reshape(rows, -1, 2, 64), 64)
    qh = blk[..., 128:192].reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    q = (ql.reshape(rows, -1) | ((qh & 3) << 4).reshape(rows, -1)).astype(np.uint8)
    return q, [_f16(blk[..., 208:210]), blk[..., 192:208]]


def _pack_quants(name: str, q: np.ndarray) -> np.ndarray:
    """[g, 16, k] unsigned quants -> [g, nb, qbytes]."""
    g, _, k = q.shape
    d = q.reshape(g, ROWS, k // 32, 8, 4).transpose(0, 2, 3, 1, 4)  # [g, nb32, t, r, i]
    if name == "Q8_0":
        return d.reshape(g, k // 32, -1)
    lo = (d & 0x0F).reshape(g, k // 32, 4, 2, ROWS, 4)
    parts = [lo[:, :, :, 0] | (lo[:, :, :, 1] << 4)]  # [g, nb32, chunk, r, i]
    hi = d >> 4
    if name == "Q5_K":
        bits = hi << np.arange(8, dtype=np.uint8)[:, None, None]
        parts.append(bits.sum(axis=2, dtype=np.uint8)[:, :, None])
    elif name == "Q6_K":
        bits = (
            hi.reshape(g, k // 32, 2, 4, ROWS, 4)
            << (2 * np.arange(4, dtype=np.uint8))[:, None, None]
        )
        parts.append(bits.sum(axis=3, dtype=np.uint8))
    return np.concatenate(parts, axis=2).reshape(g, k // KERNEL_FORMATS[name].block_values, -1)


def _pack_scales(scales: list[np.ndarray], g: int) -> np.ndarray:
    """Scale arrays [g * 16, nb, ...] -> [g, nb, sbytes], rows innermost."""
    out = []
    for s in scales:
        s = s.reshape(g, ROWS, s.shape[1], -1).transpose(0, 2, 3, 1)  # [g, nb, j, r]
        out.append(np.ascontiguousarray(s).view(np.uint8).reshape(g, s.shape[1], -1))
    return np.concatenate(out, axis=2)


def reference_pack(raw: np.ndarray, name: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(qs, sc) as pack_quantized lays them out, rows past n packed from zero blocks."""
    fmt = KERNEL_FORMATS[name]
    groups, nb = -(-n // ROWS), k // fmt.block_values
    blk = np.zeros((groups * ROWS, nb, fmt.block_bytes), np.uint8)
    blk[:n] = np.asarray(raw).reshape(n, nb, fmt.block_bytes)
    q, scales = _decode(name, blk)
    return _pack_quants(name, q.reshape(groups, ROWS, k)), _pack_scales(scales, groups)


# --- tests ----------------------------------------------------------------------------------


def random_rows(name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, bytes per row] random GGUF blocks (MXFP4: no 0xFF scale byte, NaN in OCP MX)."""
    fmt = KERNEL_FORMATS[name]
    blk = np.random.default_rng(seed).integers(0, 256, (n, k // fmt.block_values, fmt.block_bytes))
    blk = blk.astype(np.uint8)
    if name == "MXFP4":
        blk[..., 0] = np.minimum(blk[..., 0], 0xFE)
    return blk.reshape(n, -1)


def assert_packed(packed: quant.QuantWeight, raw: np.ndarray, name: str, n: int, k: int) -> None:
    qs, sc = reference_pack(raw, name, n, k)
    assert packed.qs.shape == qs.shape and packed.sc.shape == sc.shape
    np.testing.assert_array_equal(packed.qs.numpy(), qs)
    np.testing.assert_array_equal(packed.sc.numpy(), sc)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("n", [1, 16, 37, 130])
@pytest.mark.parametrize("blocks", [1, 6])
def test_equals_reference(name, n, blocks):
    k = blocks * KERNEL_FORMATS[name].block_values
    raw = random_rows(name, n, k, seed=n + blocks)
    assert_packed(quant.pack_quantized(raw, name, n, k, huge_pages=False), raw, name, n, k)


@pytest.mark.parametrize("name", FORMATS)
def test_every_thread_count_and_huge_pages(name):
    """A matrix large enough for the parallel region, on huge pages, 1 and 2 threads."""
    n, k = 200, 8 * KERNEL_FORMATS[name].block_values
    raw = random_rows(name, n, k, seed=3)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert_packed(quant.pack_quantized(raw, name, n, k), raw, name, n, k)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", FORMATS)
def test_views_of_the_file(name):
    """A column range of wider rows (strided, read only, as the mapped file gives), a torch
    view of it, a flat array and rows whose bytes are not dense all pack as their copy."""
    fmt = KERNEL_FORMATS[name]
    n, k = 45, 3 * fmt.block_values
    wide = random_rows(name, n, k + 2 * fmt.block_values, seed=5)
    wide.setflags(write=False)
    before = wide.copy()
    cols = slice(fmt.block_bytes, fmt.block_bytes + k // fmt.block_values * fmt.block_bytes)
    view = wide[:, cols]
    assert not view.flags.c_contiguous
    dense = np.ascontiguousarray(view)
    assert_packed(quant.pack_quantized(view, name, n, k), dense, name, n, k)
    assert_packed(
        quant.pack_quantized(torch.from_numpy(dense)[:, :], name, n, k), dense, name, n, k
    )
    assert_packed(quant.pack_quantized(dense.reshape(-1), name, n, k), dense, name, n, k)
    spread = np.zeros((n, dense.shape[1], 2), np.uint8)
    spread[..., 0] = dense
    assert_packed(quant.pack_quantized(spread[..., 0], name, n, k), dense, name, n, k)
    np.testing.assert_array_equal(wide, before)


def test_one_row_of_any_stride():
    raw = random_rows("Q4_K", 3, 256, seed=7)
    assert_packed(quant.pack_quantized(raw[1:2], "Q4_K", 1, 256), raw[1:2], "Q4_K", 1, 256)
    assert_packed(quant.pack_quantized(raw[::2][1:], "Q4_K", 1, 256), raw[2:3], "Q4_K", 1, 256)


@pytest.mark.parametrize("gate_up, down", [("Q4_K", "Q6_K"), ("MXFP4", "Q8_0")])
def test_expert_stack_from_views(gate_up, down):
    """Gate and up rows of each expert as two views of one read-only [E, rows, bytes] tensor
    (a group of 16 rows takes both), down rows as a column range: one native call."""
    experts, inter, hidden = 3, 24, 2 * KERNEL_FORMATS[gate_up].block_values
    gate, up = (random_rows(gate_up, experts * inter, hidden, seed=s) for s in (1, 2))
    gate, up = gate.reshape(experts, inter, -1), up.reshape(experts, inter, -1)
    wide = random_rows(down, experts * hidden, 3 * KERNEL_FORMATS[down].block_values, seed=3)
    wide = wide.reshape(experts, hidden, -1)
    cols = slice(KERNEL_FORMATS[down].block_bytes, 3 * KERNEL_FORMATS[down].block_bytes)
    for a in (gate, up, wide):
        a.setflags(write=False)
    stack = quant_stack(lambda e: (gate[e], up[e]), gate_up, 2 * inter, hidden, experts)
    for e in range(experts):
        qs, sc = reference_pack(np.concatenate([gate[e], up[e]]), gate_up, 2 * inter, hidden)
        np.testing.assert_array_equal(stack.data[e].numpy(), qs)
        np.testing.assert_array_equal(stack.scales[e].numpy(), sc)
    k = 2 * KERNEL_FORMATS[down].block_values
    stack = quant_stack([wide[e][:, cols] for e in range(experts)], down, hidden, k)
    for e in range(experts):
        qs, sc = reference_pack(np.ascontiguousarray(wide[e][:, cols]), down, hidden, k)
        np.testing.assert_array_equal(stack.data[e].numpy(), qs)
        np.testing.assert_array_equal(stack.scales[e].numpy(), sc)


def test_expert_stack_errors():
    rows = [random_rows("MXFP4", 20, 64, seed=e) for e in range(3)]
    with pytest.raises(ValueError, match=r"raw of 1: expected 20 x 34 uint8"):
        quant_stack([rows[0], (rows[1], rows[1][:3]), rows[2]], "MXFP4", 20, 64)
    rows[2][7, 0] = 0xFF
    with pytest.raises(ValueError, match=r"MXFP4 weights of 2: 1 MXFP4 block.*row 7, block 0"):
        quant_stack(rows, "MXFP4", 20, 64)


def test_errors_name_what_to_change():
    raw = random_rows("Q4_K", 4, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        quant.pack_quantized(raw, "Q4_K", 4, 128)
    with pytest.raises(ValueError, match=r"raw: expected 4 x 144 uint8"):
        quant.pack_quantized(raw[:3], "Q4_K", 4, 256)
    with pytest.raises(ValueError, match="uint8"):
        quant.pack_quantized(raw.astype(np.int16), "Q4_K", 4, 256)
    with pytest.raises(ValueError, match="not supported"):
        quant.pack_quantized(raw, "Q2_K", 4, 256)
    with pytest.raises(ValueError, match=r"bias: expected a float \[4\]"):
        quant.pack_quantized(raw, "Q4_K", 4, 256, bias=torch.zeros(5))
    with pytest.raises(ValueError, match="packed tensors: expected a contiguous uint8"):
        quant.pack_quantized(raw, "Q4_K", 4, 256, alloc=lambda s, d: torch.empty((1, 1), dtype=d))
    mx = random_rows("MXFP4", 4, 64)
    mx[2, 17] = 0xFF  # row 2, block 1's scale
    with pytest.raises(ValueError, match=r"0xFF.*row 2, block 1"):
        quant.pack_quantized(mx, "MXFP4", 4, 64)


def test_native_argument_checks():
    qs, sc = torch.zeros(2 * 512, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    raw = np.zeros((17, 34), np.uint8)
    rows = raw.__array_interface__["data"][0] + 34 * np.arange(17, dtype=np.int64)
    lib, code, nans = _loader.lib, KERNEL_FORMATS["Q8_0"].code, _loader.ffi.new("int64_t *")
    table = rows.ctypes.data

    def pack(qtype=code, table=table, E=1, N=17, K=32):
        return lib.cpud_quant_pack(qtype, table, E, N, K, qs.data_ptr(), sc.data_ptr(), nans)

    assert pack() == 0 and nans[0] == 0
    assert pack(qtype=99) == -2
    assert pack(table=0) == -2
    assert pack(E=0) == -2
    assert pack(N=0) == -2
    assert pack(K=48) == -2
    rows[5] = 0
    assert pack() == -2  # a null row


def test_mxfp4_nan_scales_counted():
    raw = random_rows("MXFP4", 3, 64)
    raw[[0, 0, 2], [0, 17, 17]] = 0xFF
    rows = raw.__array_interface__["data"][0] + raw.strides[0] * np.arange(3, dtype=np.int64)
    qs, sc = torch.zeros(2 * 256, dtype=torch.uint8), torch.zeros(2 * 16, dtype=torch.uint8)
    nans = _loader.ffi.new("int64_t *")
    code = KERNEL_FORMATS["MXFP4"].code
    assert (
        _loader.lib.cpud_quant_pack(
            code, rows.ctypes.data, 1, 3, 64, qs.data_ptr(), sc.data_ptr(), nans
        )
        == 0
    )
    assert nans[0] == 3
