"""MXFP4 (GGUF type 39): the packed kernels on every code and on extreme exponents, on every
kernel variant here; the Hugging Face layout's converter against transformers' own
dequantization; scale byte 0xFF (NaN in OCP MX) refused, from the packer to a model load; a GGUF
file whose linears are MXFP4 loads onto the packed GEMM and matches transformers.

The exact-arithmetic check: x is integers in [-127, 127] times 2^-3 with a +-127 in every block
of 32, so its int8 rounding is exact (scale 2^-3) and every weight scale times x's scale is a
power of two (exact, denormal ones too, down to 2^-131).  What remains is fp32 rounding of the
per-block products and their sum: at most 1e-6 of |x| @ |W|^T."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from test_gguf_model import prompt_of, reference

from cpud import LLM, SamplingParams, native
from cpud.model.quant_check import quantized_bytes
from cpud.native import quant
from cpud.native.mxfp4 import E2M1_DOUBLED, from_hf_blocks, to_hf_blocks
from cpud.ranks.fused_decoder import FusedDecoder
from cpud.ranks.gguf_blocks import slice_blocks
from cpud.ranks.quant_plan import weight_formats
from cpud.settings.errors import ConfigError
from hf_reference import hf_logits

pytestmark = pytest.mark.skipif(
    not native.available(), reason=f"native kernels not built: {native.load_error()}"
)

TIERS = native.supported_isas() if native.available() else []
VARIANTS = (
    [("scalar", True)]
    + [(isa, v) for isa in ("avx2", "avx512") if isa in TIERS for v in (False, True)]
    + [("amx", True)] * ("amx" in TIERS)
)
# one exponent per weight row: the denormal scales (0, 1), 2, around 1.0 (127, 128), far out
EXPONENTS = np.array([0, 1, 2, 3, 64, 120, 126, 127, 128, 129, 134, 200, 230], np.uint8)


def extreme_rows(n: int, k: int, seed: int) -> np.ndarray:
    """[n, k/32 * 17] GGUF MXFP4 rows: every code in every row, row r's blocks all scaled by
    EXPONENTS[r % len]."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, (n, k // 32, 32), dtype=np.uint8)
    codes[:, 0, :16] = np.arange(16, dtype=np.uint8)
    blocks = np.empty((n, k // 32, 17), np.uint8)
    blocks[..., 0] = EXPONENTS[np.arange(n) % len(EXPONENTS)][:, None]
    blocks[..., 1:] = codes[..., :16] | (codes[..., 16:] << 4)
    return blocks.reshape(n, -1)


def exact_x(m: int, k: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    x = rng.integers(-127, 128, (m, k // 32, 32)).astype(np.float32)
    x[:, :, 0] = np.where(rng.random((m, k // 32)) < 0.5, -127, 127)
    return torch.from_numpy(x.reshape(m, k) * np.float32(2.0**-3))


@pytest.mark.parametrize("isa, vnni", VARIANTS)
@pytest.mark.parametrize("M", [1, 2, 7, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_code_and_extreme_exponents(isa, vnni, M, dtype):
    N, K = 33, 32 * 21
    raw = extreme_rows(N, K, seed=N)
    w = dequantize(raw, T.MXFP4).reshape(N, K).astype(np.float64)
    assert np.all(np.isfinite(w)) and w[0, 0] == 0 and w[0, 7] == 12 * 2.0**-128
    packed = quant.pack_quantized(raw, "MXFP4", N, K)
    assert packed.gguf_bytes == raw.size and packed.weight_bytes == 3 * 21 * (256 + 16)
    x = exact_x(M, K, seed=M).to(dtype)
    got = quant.quant_gemm(x, packed, torch.empty(M, N), isa=isa, vnni=vnni, amx_bf16=False)
    xf = x.double().numpy()
    want, mag = xf @ w.T, np.abs(xf) @ np.abs(w).T
    np.testing.assert_array_less(np.abs(got.double().numpy() - want), 1e-6 * mag + 1e-300)
    assert np.all(mag[:, 0] > 0) and np.all(np.abs(got.numpy()[:, 0]) < 1e-30)  # the 2^-128 row


def test_values_are_ggufs():
    """gguf's quantizer and ggml's value table: the codes' doubled E2M1 values; the control
    plane's sizes (memory plan, doctor) read the same table."""
    assert quantized_bytes(33, "MXFP4") == 2 * 17
    assert E2M1_DOUBLED == tuple(gguf.quants.MXFP4.kvalues)
    raw = quantize(np.linspace(-6, 6, 64, dtype=np.float32).reshape(1, 64), T.MXFP4)
    assert raw.shape == (1, 34) and raw[0, 0] == 127  # amax 6: floor(log2 6) - 2 + 127 = 127
    assert dequantize(raw, T.MXFP4)[0, [0, -1]].tolist() == [-6.0, 6.0]


def hf_blocks(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (*shape, 16), dtype=np.uint8)
    scales = rng.integers(118, 136, shape, dtype=np.uint8)
    return torch.from_numpy(blocks), torch.from_numpy(scales)


def test_hf_layout_converts_to_ggufs_values():
    """gpt-oss's gate_up_proj_blocks [E, 2I, H/32, 16] and _scales [E, 2I, H/32]: transformers
    dequantizes them to [E, H, 2I]; the GGUF rows of from_hf_blocks hold the same values, row
    for row (exact: both are small integers times powers of two)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    E, rows, G = 3, 10, 4
    blocks, scales = hf_blocks((E, rows, G), seed=5)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, G*32, rows]
    gguf_rows = from_hf_blocks(blocks, scales)
    assert gguf_rows.shape == (E, rows, G * 17) and gguf_rows.dtype == np.uint8
    got = dequantize(gguf_rows.reshape(E * rows, -1), T.MXFP4).reshape(E, rows, G * 32)
    assert torch.equal(torch.from_numpy(got).transpose(1, 2), want)
    back = to_hf_blocks(gguf_rows)
    assert np.array_equal(back[0], blocks.numpy()) and np.array_equal(back[1], scales.numpy())


def test_hf_rows_run_on_the_packed_gemm():
    blocks, scales = hf_blocks((40, 5), seed=9)  # W [40, 160]
    packed = quant.pack_quantized(from_hf_blocks(blocks, scales), "MXFP4", 40, 160)
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.float32)[0].T.double()
    x = exact_x(3, 160, seed=2)
    got = quant.quant_gemm(x, packed).double()
    want = x.double() @ w.T
    assert torch.all((got - want).abs() <= 1e-6 * (x.double().abs() @ w.abs().T))


def test_converter_refuses_bad_shapes():
    with pytest.raises(ValueError, match=r"\[\.\.\., G, 16\]"):
        from_hf_blocks(np.zeros((2, 3, 16), np.uint8), np.zeros((2, 4), np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        from_hf_blocks(np.zeros((2, 16), np.int8), np.zeros((2,), np.uint8))
    with pytest.raises(ValueError, match="multiple of 17"):
        to_hf_blocks(np.zeros((2, 18), np.uint8))


def test_nan_scale_refused_by_the_packer():
    raw = extreme_rows(4, 64, seed=1)
    raw[2, 17] = 0xFF  # row 2, block 1
    with pytest.raises(ValueError, match=r"1 MXFP4 block.*0xFF.*row 2, block 1\)"):
        quant.pack_quantized(raw, "MXFP4", 4, 64)


@pytest.fixture(scope="module")
def mxfp4_llama(gguf_file):
    return gguf_file("llama", T.MXFP4)


def test_nan_scale_refused_at_load(mxfp4_llama, tmp_path):
    """A file with one damaged block: a ConfigError naming the tensor, from the slice every
    load path reads (packed or dequantized)."""
    bad = tmp_path / "bad.gguf"
    shutil.copy(mxfp4_llama, bad)
    tensor = next(t for t in gguf.GGUFReader(bad).tensors if t.name == "blk.1.ffn_down.weight")
    with open(bad, "r+b") as f:
        f.seek(int(tensor.data_offset) + 17 * 3)
        f.write(b"\xff")
    reader = gguf.GGUFReader(bad)
    tensor = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    with pytest.raises(
        ConfigError, match=r"blk\.1\.ffn_down\.weight: 1 MXFP4 block.*row 0, block 3"
    ):
        slice_blocks(tensor, slice(None))
    slice_blocks(tensor, slice(1, None))  # the damaged block is in row 0
    with pytest.raises(ConfigError, match=r"blk\.1\.ffn_down\.weight.*0xFF"):
        LLM(bad, dtype="float32", kernels="native", weight_cache="off")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gguf_file_logits_close_to_transformers(arch, dtype, gguf_file, hf_gguf):
    """Every linear MXFP4 (gguf-quantized), packed and run by the int8 kernels, against
    transformers' fp32 model on gguf's dequantized weights; the bounds of
    test_gguf_quantized.test_logits_close_to_transformers."""
    from test_gguf_quantized import prefill_logits, runner

    path = gguf_file(arch, T.MXFP4)
    run = runner(path, dtype)
    assert isinstance(run.decoder, FusedDecoder)
    assert run.model.lm_head.quant[0][1].qtype == "MXFP4"
    formats = {fmt: (count, kernel) for fmt, count, kernel in weight_formats(path)}
    assert "int8 dot" in formats["MXFP4"][1], formats
    prompt = prompt_of(40, seed=1)
    want = hf_logits(reference(hf_gguf, gguf_file, arch, T.MXFP4), prompt)
    got = prefill_logits(run, prompt)
    error = (got - want).abs() / want.std()
    assert float(error.max()) < 0.6 and float(error.mean()) < 0.05, (error.max(), error.mean())
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.8


@pytest.mark.slow
def test_gguf_file_greedy_tokens_match_transformers(mxfp4_llama, gguf_file, hf_gguf):
    from hf_reference import hf_greedy

    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    model = reference(hf_gguf, gguf_file, "llama", T.MXFP4)
    prompts = [prompt_of(5 + 3 * s, seed=s) for s in range(12)]
    llm = LLM(mxfp4_llama, dtype="float32", kernels="native", weight_cache="off")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    want = [hf_greedy(model, p, greedy.max_tokens) for p in prompts]
    prefix = [
        next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), 8) for g, w in zip(got, want)
    ]
    assert sum(p > 0 for p in prefix) >= 9 and sum(prefix) >= 4 * len(prompts), prefix


@pytest.mark.slow
def test_tp2_and_weight_cache_equal_one_rank(mxfp4_llama, tmp_path):
    """Row-parallel ranks take whole 32-value MXFP4 blocks of their K halves; the weight cache
    keeps the packed codes and exponent bytes (uint8) and reloads them to the same tokens."""
    prompts = [[5, 6, 7, 8, 9], list(range(10, 90)), [300, 12, 44]]
    kw = dict(dtype="float32", kernels="native")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    runs = []
    for _ in range(2):
        with LLM(mxfp4_llama, weight_cache=str(tmp_path), **kw) as llm:
            runs.append([o.outputs[0] for o in llm.generate(prompts, params)])
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    (index,) = tmp_path.glob("*.json")
    assert any(e["name"] == "lm_head.q0.sc" for e in json.loads(index.read_text())["tensors"])
    with LLM(mxfp4_llama, tp=2, bind="0|1", weight_cache="off", **kw) as llm:
        got = [o.outputs[0] for o in llm.generate(prompts, params)]
    for one, two in zip(runs[0], got):
        for step, (token, top) in enumerate(zip(one.token_ids, one.logprobs)):
            first, second = sorted((lp.logprob for lp in top.values()), reverse=True)[:2]
            if first - second < 0.02:  # a near tie: the K halves' sums add in another order
                break
            assert two.token_ids[step] == token, (step, one.token_ids, two.token_ids)
            assert abs(two.logprobs[step][token].logprob - top[token].logprob) < 0.05


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_torch_kernels_dequantize_to_transformers_weights(arch, gguf_file, hf_gguf):
    """--kernels torch dequantizes MXFP4 blocks at load (gguf's dequantizer): the same fp32
    weights as transformers', so only the summation order differs (test_gguf_model's bound)."""
    from test_gguf_model import runner_logits

    path = gguf_file(arch, T.MXFP4)
    prompt = prompt_of(40, seed=1)
    want = hf_logits(reference(hf_gguf, gguf_file, arch, T.MXFP4), prompt)
    got = runner_logits(path, prompt)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.std()))
