"""The kernels decoder recipes beyond Llama need: RMSNorm with an f32 weight (Gemma's one
rounding), gated GELU-tanh, and their torch references in ``TorchOps``; at every ISA tier.

Where torch and the kernels sum or take rsqrt / exp in another order, results are compared
within ``tolerances.TOL`` and, for bf16, also required bit-exact on nearly every element: a
kernel that rounded once too often (or used another GELU) would miss that by far."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tolerances import assert_close

from cpud.native import _loader
from cpud.ranks.layers.rotary import cos_sin_table
from cpud.ranks.ops import NativeOps, TorchOps

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(1, 64), (3, 80), (7, 1030), (33, 129)]
F32, BF16, EARG = 0, 1, -2


def gemma_rms(x: torch.Tensor, w32: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma3RMSNorm with its 1 + w already in the f32 weight."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w32).to(x.dtype)


def llama_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def exact_share(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a == b).float().mean().item()


def gemma_weight(hidden: int) -> torch.Tensor:
    """1 + w in fp32 for a small bf16 w: most values are not bf16 numbers."""
    return 1.0 + (0.3 * torch.randn(hidden)).to(torch.bfloat16).float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, H", SHAPES)
def test_rms_norm_f32_weight_is_gemma_form(kern, dtype, T, H):
    x = torch.randn(T, H, dtype=dtype) * 3
    w = gemma_weight(H)
    expected = gemma_rms(x, w, 1e-6)
    out = kern.rms_norm(x, w, 1e-6, out=torch.empty_like(x))
    assert_close(out, expected, dtype)
    if dtype == torch.bfloat16:
        assert exact_share(out, expected) >= 0.999
    y = x.clone()
    kern.rms_norm(y, w, 1e-6)  # in place
    assert torch.equal(y, out)


def test_gemma_form_rounds_once_where_llama_rounds_twice(kern):
    x = torch.randn(16, 1024, dtype=torch.bfloat16) * 3
    w = gemma_weight(1024)
    gemma = kern.rms_norm(x, w, 1e-6, out=torch.empty_like(x))
    llama = kern.rms_norm(x, w.to(torch.bfloat16), 1e-6, out=torch.empty_like(x))
    assert exact_share(gemma, gemma_rms(x, w, 1e-6)) >= 0.999
    # the double rounding of the bf16 weight path gives other bits on a good share of elements
    assert exact_share(gemma, llama) < 0.9
    assert exact_share(llama, llama_rms(x, w.to(torch.bfloat16), 1e-6)) >= 0.999


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_f32_weight(kern, dtype):
    # Gemma 3's q/k norms: [T, nh, hd] views of a fused qkv output
    T, nh, nkv, hd = 5, 4, 2, 80
    qkv = torch.randn(T, (nh + 2 * nkv) * hd, dtype=dtype)
    q = qkv[:, : nh * hd].view(T, nh, hd)
    w = gemma_weight(hd)
    expected = gemma_rms(q, w, 1e-6)
    rest = qkv[:, nh * hd :].clone()
    kern.rms_norm(q, w, 1e-6)
    assert_close(q, expected, dtype)
    assert torch.equal(qkv[:, nh * hd :], rest)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, H", SHAPES)
def test_fused_add_rms_norm_f32_weight(kern, dtype, T, H):
    x = torch.randn(T, H, dtype=dtype)
    res = torch.randn(T, H, dtype=dtype)
    w = gemma_weight(H)
    new_res = res + x
    expected = gemma_rms(new_res, w, 1e-6)
    kern.fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(res, new_res)
    assert_close(x, expected, dtype)
    if dtype == torch.bfloat16:
        assert exact_share(x, expected) >= 0.999


@pytest.mark.parametrize("dtype", DTYPES)
def test_llama_rounding_unchanged(kern, dtype):
    x = torch.randn(9, 1030, dtype=dtype) * 3
    w = torch.randn(1030, dtype=dtype)
    out = kern.rms_norm(x, w, 1e-6, out=torch.empty_like(x))
    assert_close(out, llama_rms(x, w, 1e-6), dtype)
    if dtype == torch.bfloat16:
        assert exact_share(out, llama_rms(x, w, 1e-6)) >= 0.999


def test_norm_weight_dtype_checked(kern):
    with pytest.raises(ValueError, match="weight"):  # a bf16 weight on f32 rows
        kern.rms_norm(torch.randn(2, 8), torch.ones(8, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        kern.fused_add_rms_norm(
            torch.randn(2, 8), torch.randn(2, 8), torch.ones(8, dtype=torch.bfloat16), 1e-6
        )
    x = torch.randn(2, 8)
    res = torch.randn(2, 8)
    w = torch.ones(8)
    code = _loader.ISAS.index(kern.isa)
    for wdt in (BF16, 7):  # a bf16 weight on f32 rows, and no dtype at all
        rc = _loader.lib.cpud_rms_norm(
            code, F32, x.data_ptr(), 8, x.data_ptr(), 8, w.data_ptr(), wdt, 2, 1, 8, 1e-6
        )
        assert rc == EARG
        rc = _loader.lib.cpud_fused_add_rms_norm(
            code, F32, x.data_ptr(), 8, res.data_ptr(), 8, w.data_ptr(), wdt, 2, 8, 1e-6
        )
        assert rc == EARG


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, inter", [(1, 64), (3, 80), (9, 1031), (17, 3072)])
def test_gelu_tanh_and_mul(kern, dtype, T, inter):
    x = torch.randn(T, 2 * inter, dtype=dtype) * 4
    gate, up = x[:, :inter], x[:, inter:]
    expected = F.gelu(gate, approximate="tanh") * up  # HF's GELUTanh MLP in the model dtype
    out = kern.gelu_tanh_and_mul(x)
    assert out.shape == (T, inter) and out.dtype == dtype
    assert_close(out, expected, dtype)
    if dtype == torch.bfloat16:
        # torch's 1 + tanh(u) loses digits as the gate falls below about -2.5 (the kernel's
        # g sigmoid(2u) does not): above it nearly every element has torch's bits
        keep = gate > -2.5
        assert exact_share(out[keep], expected[keep]) >= 0.995


def test_gelu_tanh_and_mul_strided_and_out(kern):
    inter = 40
    buf = torch.randn(6, 2 * inter + 8, dtype=torch.bfloat16)
    x = buf[:, : 2 * inter]  # token stride 2I + 8
    out_buf = torch.zeros(6, inter + 3, dtype=torch.bfloat16)
    out = out_buf[:, :inter]
    assert kern.gelu_tanh_and_mul(x, out=out) is out
    assert torch.equal(out, kern.gelu_tanh_and_mul(x.contiguous()))
    assert torch.equal(out_buf[:, inter:], torch.zeros(6, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="even"):
        kern.gelu_tanh_and_mul(torch.randn(2, 7))


def test_gelu_tanh_differs_from_silu(kern):
    x = torch.randn(4, 256) * 2
    assert not torch.allclose(kern.gelu_tanh_and_mul(x), kern.silu_and_mul(x), atol=1e-2)


# ------------------------------------------------------------------ TorchOps / NativeOps


def test_torch_ops_norm_matches_gemma3_rmsnorm():
    gemma3 = pytest.importorskip("transformers.models.gemma3.modeling_gemma3")
    norm = gemma3.Gemma3RMSNorm(96, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96) * 0.3)
    x = torch.randn(5, 96, dtype=torch.bfloat16) * 2
    folded = 1.0 + norm.weight.detach().float()
    with torch.no_grad():
        assert torch.equal(TorchOps().rms_norm(x, folded, 1e-6), norm(x))
        res = torch.randn(5, 96, dtype=torch.bfloat16)
        normed, summed = TorchOps().add_rms_norm(x, res, folded, 1e-6)
        assert torch.equal(summed, x + res)
        assert torch.equal(normed, norm(x + res))


def test_torch_ops_gelu_tanh_matches_hf_activation():
    activations = pytest.importorskip("transformers.activations")
    act = activations.ACT2FN["gelu_pytorch_tanh"]
    x = torch.randn(3, 64, dtype=torch.bfloat16) * 3
    assert torch.equal(TorchOps().gelu_tanh_and_mul(x), act(x[:, :32]) * x[:, 32:])


@pytest.mark.parametrize("neox", [True, False])
def test_native_ops_pass_the_recipe_through(kern, neox):
    ops, ref = NativeOps(kern), TorchOps()
    x = torch.randn(7, 130, dtype=torch.bfloat16) * 3
    w = gemma_weight(130)
    assert_close(ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), torch.bfloat16)
    res = torch.randn(7, 130, dtype=torch.bfloat16)
    exp_normed, exp_summed = ref.add_rms_norm(x.clone(), res.clone(), w, 1e-6)
    normed, summed = ops.add_rms_norm(x.clone(), res.clone(), w, 1e-6)
    assert torch.equal(summed, exp_summed)
    assert_close(normed, exp_normed, torch.bfloat16)
    assert_close(ops.gelu_tanh_and_mul(x), ref.gelu_tanh_and_mul(x), torch.bfloat16)
    cache = cos_sin_table(64, 50, 10000.0)
    pos = torch.randint(0, 50, (7,))
    q, k = torch.randn(7, 4, 64), torch.randn(7, 2, 64)
    eq, ek = ref.rotary(pos, q.clone(), k.clone(), cache, neox=neox)
    gq, gk = ops.rotary(pos, q.clone(), k.clone(), cache, neox=neox)
    assert_close(gq, eq, torch.float32)
    assert_close(gk, ek, torch.float32)
    other_q, _ = ref.rotary(pos, q.clone(), k.clone(), cache, neox=not neox)
    assert not torch.allclose(other_q, eq, atol=1e-3)
