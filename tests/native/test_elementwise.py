"""rms_norm, fused_add_rms_norm, rotary embedding, silu_and_mul, argmax, KV-cache write."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tolerances import assert_close

from cpud.ranks.layers.rotary import cos_sin_table, rope_inv_freq

DTYPES = [torch.float32, torch.bfloat16]


def ref_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, H", [(1, 64), (3, 80), (7, 1030), (33, 128)])
def test_rms_norm(kern, dtype, T, H):
    x = torch.randn(T, H, dtype=dtype) * 3
    w = torch.randn(H, dtype=dtype)
    expected = ref_rms(x, w, 1e-6)
    out = torch.empty_like(x)
    assert kern.rms_norm(x, w, 1e-6, out=out) is out
    assert_close(out, expected, dtype)
    y = x.clone()
    kern.rms_norm(y, w, 1e-6)  # in place
    assert_close(y, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_on_qkv_slice(kern, dtype):
    # Qwen3 q-norm: [T, nh, hd] view of a fused qkv output (token stride > nh * hd).
    T, nh, nkv, hd = 5, 4, 2, 80
    qkv = torch.randn(T, (nh + 2 * nkv) * hd, dtype=dtype)
    q = qkv[:, : nh * hd].view(T, nh, hd)
    w = torch.randn(hd, dtype=dtype)
    expected = ref_rms(q, w, 1e-5)
    rest = qkv[:, nh * hd :].clone()
    kern.rms_norm(q, w, 1e-5)
    assert_close(q, expected, dtype)
    assert torch.equal(qkv[:, nh * hd :], rest)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, H", [(1, 64), (5, 1030), (17, 128)])
def test_fused_add_rms_norm(kern, dtype, T, H):
    x = torch.randn(T, H, dtype=dtype)
    res = torch.randn(T, H, dtype=dtype)
    w = torch.randn(H, dtype=dtype)
    new_res = res + x  # HF: residual + hidden in the model dtype
    expected = ref_rms(new_res, w, 1e-6)
    kern.fused_add_rms_norm(x, res, w, 1e-6)
    assert_close(res, new_res, dtype)
    assert_close(x, expected, dtype)


def ref_rope(pos, x, cache, neox):
    rot = cache.shape[1]
    half = rot // 2
    cos = cache[pos, :half][:, None, :]
    sin = cache[pos, half:][:, None, :]
    xr = x[..., :rot].float()
    if neox:
        x1, x2 = xr[..., :half], xr[..., half:]
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    out = x.clone()
    out[..., :rot] = rotated.to(x.dtype)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("hd, rot", [(64, 64), (80, 80), (128, 128), (128, 64), (80, 40)])
def test_rotary(kern, dtype, neox, hd, rot):
    T, nh, nkv, max_pos = 7, 8, 2, 300
    cache = cos_sin_table(rot, max_pos, 10000.0)
    pos = torch.randint(0, max_pos, (T,), dtype=torch.int64)
    qkv = torch.randn(T, (nh + 2 * nkv) * hd, dtype=dtype)  # q, k as strided views
    q = qkv[:, : nh * hd].view(T, nh, hd)
    k = qkv[:, nh * hd : (nh + nkv) * hd].view(T, nkv, hd)
    v_before = qkv[:, (nh + nkv) * hd :].clone()
    eq, ek = ref_rope(pos, q, cache, neox), ref_rope(pos, k, cache, neox)
    kern.rotary_embedding(pos, q, k, cache, is_neox=neox)
    assert_close(q, eq, dtype)
    assert_close(k, ek, dtype)
    assert torch.equal(qkv[:, (nh + nkv) * hd :], v_before)


def test_rotary_rejects_position_beyond_cache(kern):
    cache = cos_sin_table(64, 16, 10000.0)
    q = torch.randn(2, 1, 64)
    with pytest.raises(ValueError, match="rotary_embedding"):
        kern.rotary_embedding(torch.tensor([3, 16]), q, None, cache)


def test_rope_cache_llama3_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = transformers.LlamaConfig(
        hidden_size=2048,
        num_attention_heads=32,
        head_dim=64,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rope_scaling=scaling,
    )
    inv_hf, factor = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    assert factor == 1.0
    inv, _ = rope_inv_freq(64, 500000.0, scaling, 131072)
    torch.testing.assert_close(inv, inv_hf.float(), rtol=1e-6, atol=0)
    cache = cos_sin_table(64, 50, 500000.0, scaling)
    freqs = torch.arange(50, dtype=torch.float32)[:, None] * inv_hf.float()[None, :]
    torch.testing.assert_close(cache, torch.cat([freqs.cos(), freqs.sin()], -1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T, inter", [(1, 64), (3, 80), (9, 1031), (17, 3072)])
def test_silu_and_mul(kern, dtype, T, inter):
    x = torch.randn(T, 2 * inter, dtype=dtype) * 4
    expected = F.silu(x[:, :inter]) * x[:, inter:]  # HF MLP rounding in the model dtype
    assert_close(kern.silu_and_mul(x), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, n", [(1, 1), (1, 255), (3, 256), (5, 1031), (32, 151936)])
def test_argmax_matches_torch(kern, dtype, rows, n):
    x = torch.randn(rows, n).to(dtype)
    assert torch.equal(kern.argmax(x), x.max(dim=-1).indices)


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_first_of_ties_and_edge_rows(kern, dtype):
    n = 5000
    x = torch.randn(6, n).to(dtype)
    x[0, [4000, 17, 2600]] = 50.0  # ties in different blocks: the first wins
    x[1, 3000] = 50.0
    x[1, 3001] = float("nan")  # NaN never counts
    x[1, 0] = float("nan")
    x[2] = float("-inf")  # nothing above -inf: 0, as torch
    x[3] = 0.0
    x[3, n - 1] = 1e-3  # in the last, partial block
    x[4] = float("-inf")
    x[4, 777] = float("inf")
    x[5] = -1.0  # all equal: the first
    assert kern.argmax(x).tolist() == [17, 3000, 0, n - 1, 777, 0]
    rows = torch.randn(4, 300).to(dtype)
    padded = torch.randn(4, 512).to(dtype)
    padded[:, :300] = rows
    assert torch.equal(kern.argmax(padded[:, :300]), rows.max(dim=-1).indices)  # row stride


def test_argmax_rejects_bad_inputs(kern):
    with pytest.raises(ValueError, match="dtype"):
        kern.argmax(torch.randn(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="empty"):
        kern.argmax(torch.randn(2, 0))
    with pytest.raises(ValueError, match="contiguous"):
        kern.argmax(torch.randn(8, 2).t())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hd", [64, 80, 128])
@pytest.mark.parametrize("bs", [16, 128])
def test_write_kv_cache(kern, dtype, hd, bs):
    T, nkv, nh, num_blocks = 33, 2, 4, 5
    qkv = torch.randn(T, (nh + 2 * nkv) * hd, dtype=dtype)
    key = qkv[:, nh * hd : (nh + nkv) * hd].view(T, nkv, hd)
    value = qkv[:, (nh + nkv) * hd :].view(T, nkv, hd)
    kc = torch.zeros(num_blocks, nkv, bs, hd, dtype=dtype)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(num_blocks * bs)[:T].to(torch.int64)
    slots[3] = -1  # padding token: skipped
    ek, ev = kc.clone(), vc.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            ek[s // bs, :, s % bs] = key[t]
            ev[s // bs, :, s % bs] = value[t]
    kern.write_kv_cache(key, value, kc, vc, slots)
    assert torch.equal(kc, ek) and torch.equal(vc, ev)
    with pytest.raises(ValueError, match="slot"):
        kern.write_kv_cache(key, value, kc, vc, torch.full((T,), num_blocks * bs))


def test_wrappers_reject_bad_inputs(kern):
    with pytest.raises(ValueError, match="dtype"):
        kern.rms_norm(
            torch.randn(2, 8, dtype=torch.float16), torch.ones(8, dtype=torch.float16), 1e-6
        )
    with pytest.raises(ValueError, match="weight"):
        kern.rms_norm(torch.randn(2, 8), torch.ones(9), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        kern.rms_norm(torch.randn(8, 2).t(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="even"):
        kern.silu_and_mul(torch.randn(2, 7))
