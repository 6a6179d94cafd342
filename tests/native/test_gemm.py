"""Skinny GEMM over packed bf16 weights vs torch (fp64 reference)."""

from __future__ import annotations

import functools
import operator

import pytest
import torch

from cpud import native


def reference(x, w, bias, isa):
    # The avx512bf16 and amx tiers feed vdpbf16ps / tdpbf16ps, so fp32 x is rounded to bf16 first.
    xr = x.to(torch.bfloat16) if isa in ("avx512bf16", "amx") else x
    y = xr.double() @ w.to(torch.bfloat16).double().T
    return y if bias is None else y + bias.double()


def check(out, ref, K):
    # fp32 accumulation in a different order: error grows ~ sqrt(K) * |x||w|;
    # a bf16 output adds one rounding (2**-8 relative).
    atol = 2e-5 * K**0.5
    rtol = 8e-3 if out.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("M", [1, 3, 8, 17, 32, 45])
@pytest.mark.parametrize("N, K", [(33, 17), (64, 128), (100, 301), (257, 64)])
@pytest.mark.parametrize("xdt", [torch.bfloat16, torch.float32])
def test_gemm_packed(kern, M, N, K, xdt):
    w = torch.randn(N, K).to(torch.bfloat16)
    x = torch.randn(M, K).to(xdt)
    packed = native.pack_weight(w)
    out = kern.gemm_packed(x, packed)
    assert out.dtype == xdt and out.shape == (M, N)
    check(out, reference(x, w, None, kern.isa), K)


@pytest.mark.parametrize("odt", [torch.bfloat16, torch.float32])
def test_gemm_packed_bias_strides_and_out_dtype(kern, odt):
    M, N, K = 5, 70, 33
    w = torch.randn(N, K)
    bias = torch.randn(N)
    packed = native.pack_weight(w, bias)
    xbuf = torch.randn(M, K + 9).to(torch.bfloat16)
    x = xbuf[:, 3 : 3 + K]  # row stride K + 9
    obuf = torch.full((M, N + 4), 5.0, dtype=odt)
    out = obuf[:, :N]
    assert kern.gemm_packed(x, packed, out=out) is out
    check(out, reference(x, w, bias, kern.isa), K)
    assert torch.all(obuf[:, N:] == 5.0)


@pytest.mark.parametrize(
    "M, N, K",
    [
        *((m, n, k) for m in (4, 15, 16, 17, 31, 32, 33, 50, 64) for n, k in ((31, 31), (33, 64))),
        (17, 200, 96),
        (300, 40, 2048),  # amx: chunks of 256 rows (1 MiB of x), the last one 44 rows
    ],
)
def test_gemm_packed_across_tile_edges(kern, M, N, K):
    # The amx tier runs M >= 4 with K padded to a multiple of 32 on 16 x 16 tiles, in blocks of
    # 32 rows and chunks of ~1 MiB of x; a last partial block goes through a zero-padded copy.
    # Strided rows, a bias and a bf16 output on top, at every tier.
    w = torch.randn(N, K)
    bias = torch.randn(N)
    packed = native.pack_weight(w, bias)
    xbuf = torch.randn(M, K + 7).to(torch.bfloat16)
    x = xbuf[:, 5 : 5 + K]
    out = torch.full((M, N + 3), 7.0, dtype=torch.bfloat16)[:, :N]
    kern.gemm_packed(x, packed, out=out)
    check(out, reference(x, w, bias, kern.isa), K)


def test_pack_layout():
    N, K = 40, 5
    w = torch.arange(N * K, dtype=torch.float32).reshape(N, K)
    p = native.pack_weight(w)
    assert p.data.shape == (2, 3, 32, 2) and (p.n, p.k) == (N, K)
    assert p.data[0, 1, 7].tolist() == [w[7, 2].item(), w[7, 3].item()]
    assert p.data[1, 2, 3].tolist() == [w[35, 4].item(), 0.0]  # k padding
    assert torch.all(p.data[1, :, 8:] == 0)  # n padding


def torch_packed(w: torch.Tensor) -> torch.Tensor:
    """The packed layout built with torch ops: pad to (32, 2) multiples, then permute."""
    n, k = w.shape
    padded = torch.zeros(-(-n // 32) * 32, -(-k // 2) * 2, dtype=torch.bfloat16)
    padded[:n, :k] = w.to(torch.bfloat16)
    return padded.view(padded.shape[0] // 32, 32, padded.shape[1] // 2, 2).permute(0, 2, 1, 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("N, K", [(1, 1), (31, 7), (64, 128), (97, 301)])
@pytest.mark.parametrize("huge_pages", [True, False])
def test_native_pack_matches_torch_layout(dtype, N, K, huge_pages):
    wide = torch.randn(N, K + 5).to(dtype)
    w = wide[:, 2 : 2 + K]  # a row stride wider than K, as a column shard of a checkpoint
    p = native.pack_weight(w, huge_pages=huge_pages)
    assert torch.equal(p.data.view(torch.int16), torch_packed(w).view(torch.int16))


def test_pack_rows_in_shards_at_unaligned_offsets_equals_one_pack():
    # q, k, v shards of a fused projection land at rows 0, 40 and 64 (not panel multiples)
    parts = [torch.randn(40, 19).to(torch.bfloat16), torch.randn(24, 19), torch.randn(9, 19)]
    data = native.empty_packed(73, 19)
    row = 0
    for part in parts:
        native.pack_rows(data, row, part)
        row += part.shape[0]
    assert torch.equal(data.view(torch.int16), torch_packed(torch.cat(parts)).view(torch.int16))


def test_pack_rows_rejects_rows_outside_the_weight():
    data = native.empty_packed(40, 8)
    with pytest.raises(ValueError, match="do not fit"):
        native.pack_rows(data, 60, torch.randn(5, 8))
    with pytest.raises(ValueError, match="do not fit"):
        native.pack_rows(data, 0, torch.randn(5, 10))


def test_native_pack_rounds_fp32_like_torch():
    # ties to even both ways, a NaN, a negative zero, a value that rounds up to infinity
    w = torch.tensor([[1.0 + 2**-8, 1.0 + 3 * 2**-8, float("nan"), -0.0, 3.4e38, 1e-40]])
    got = native.pack_weight(w).data[0, :, 0].reshape(-1)[: w.shape[1]]
    want = w.to(torch.bfloat16)[0]
    assert torch.isnan(got[2]) and torch.isnan(want[2])  # NaN payloads may differ
    keep = [0, 1, 3, 4, 5]
    assert torch.equal(got[keep].view(torch.int16), want[keep].view(torch.int16))


def test_gemm_rejects_mismatch(kern):
    packed = native.pack_weight(torch.randn(8, 16))
    with pytest.raises(ValueError, match="K=15"):
        kern.gemm_packed(torch.randn(2, 15), packed)


def test_compute_probe_counts_the_tiers_multiply_adds_on_every_thread(kern):
    flops_per_instruction = {
        "scalar": 2,
        "avx2": 16,
        "avx512": 32,
        "avx512bf16": 64,
        "amx": 16 * 16 * 32 * 2,  # tdpbf16ps: a 16 x 16 fp32 tile += 16 x 32 by 32 x 16 bf16
    }[kern.isa]
    # instructions per iteration: 16 independent accumulators, 12 on avx2 (16 ymm registers)
    per_iteration = 12 if kern.isa == "avx2" else 16
    threads = native.max_threads()
    assert kern.compute_probe(1000) == 1000 * per_iteration * flops_per_instruction * threads
    assert kern.compute_probe(0) == 0
    with pytest.raises(ValueError, match="iters"):
        kern.compute_probe(-1)


def test_read_probe_checksum(kern):
    buf = torch.randint(-(2**62), 2**62, (64 * 1024 // 8,), dtype=torch.int64)
    expected = functools.reduce(operator.xor, buf.tolist()) & (2**64 - 1)
    assert kern.read_probe(buf) == expected
    with pytest.raises(ValueError, match="4096"):
        kern.read_probe(buf[:100])


STEALING_SCRIPT = """
import torch
from cpud import native
torch.manual_seed(0)
torch.set_num_threads(8)
k = native.kernels()
assert native.max_threads() == 8, native.max_threads()
ran = sum(cpu != -1 for cpu in native.thread_cpus(8))
assert 1 <= ran < 8, ran  # the runtime gave a region fewer threads than asked for
for n, kk, m in ((1000, 64, 1), (257, 96, 20), (32 * 17, 128, 3)):
    w = torch.randn(n, kk).to(torch.bfloat16)
    x = torch.randn(m, kk).to(torch.bfloat16)
    got = k.gemm_packed(x, native.pack_weight(w)).double()
    ref = x.double() @ w.double().T
    torch.testing.assert_close(got, ref, rtol=8e-3, atol=2e-5 * kk**0.5)
print("ok")
"""


def test_panels_of_threads_the_region_did_not_get_are_stolen():
    """With OMP_DYNAMIC the runtime gives a region fewer threads (here: the 2 CPUs) than the
    8 the GEMM split its panels for; the threads that run must take the missing ones' panels,
    every panel exactly once."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_DYNAMIC": "true", "OMP_NUM_THREADS": "8"}
    result = subprocess.run(
        [sys.executable, "-c", STEALING_SCRIPT], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"
