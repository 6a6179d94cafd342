"""The native mixture-of-experts kernel (native/drivers/moe.c) against a torch reference in fp64, at
every ISA tier: experts routed 0, 1 and many tokens, top-k 1, 2 and 8."""

from __future__ import annotations

import random

import pytest
import torch

from cpud import native
from cpud.ranks.layers.moe import experts_reference

E, H, INTER = 12, 64, 48
EMPTY, SINGLE = 3, 5  # expert 3 gets no token, expert 5 exactly one


def routing(tokens: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = random.Random(seed)
    pool = [e for e in range(E) if e not in (EMPTY, SINGLE)]
    ids = [rng.sample(pool, k) for _ in range(tokens)]
    ids[0][-1] = SINGLE
    weights = torch.rand(tokens, k)
    return weights / weights.sum(-1, keepdim=True), torch.tensor(ids, dtype=torch.int32)


def stacked(n: int, kdim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(plain [E, n, kdim] bf16 weights, their packed stack)."""
    w = (torch.randn(E, n, kdim) / kdim**0.5).to(torch.bfloat16)
    return w, torch.stack([native.pack_weight(w[e], huge_pages=False).data for e in range(E)])


@pytest.mark.parametrize("tokens", [1, 33])
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_experts_match_torch(kern, tokens, k, dtype):
    torch.manual_seed(tokens * 10 + k)
    gate_up, gate_up_packed = stacked(2 * INTER, H)
    down, down_packed = stacked(H, INTER)
    weights, ids = routing(tokens, k, seed=k)
    x = torch.randn(tokens, H).to(dtype)
    out = kern.moe_experts(x, gate_up_packed, down_packed, weights, ids, INTER)
    assert out.dtype == dtype and out.shape == (tokens, H)
    ref = experts_reference(x.double(), gate_up.double(), down.double(), weights.double(), ids)
    exact = dtype == torch.float32 and kern.isa not in ("avx512bf16", "amx")
    tol = 1e-4 if exact else 3e-2  # bf16 tiers round x and the activations to bf16
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    if tokens > 1:  # a token routed elsewhere gives the same output without the others
        alone = kern.moe_experts(x[1:2], gate_up_packed, down_packed, weights[1:2], ids[1:2], INTER)
        torch.testing.assert_close(alone, out[1:2], rtol=tol, atol=tol)


def test_moe_experts_rejects_bad_expert_ids(kern):
    _, gate_up = stacked(2 * INTER, H)
    _, down = stacked(H, INTER)
    x = torch.randn(2, H)
    ids = torch.tensor([[0], [E]], dtype=torch.int32)
    with pytest.raises(Exception, match="expert id out of range"):
        kern.moe_experts(x, gate_up, down, torch.ones(2, 1), ids, INTER)


def test_moe_experts_no_tokens(kern):
    _, gate_up = stacked(2 * INTER, H)
    _, down = stacked(H, INTER)
    x = torch.empty(0, H)
    ids = torch.empty(0, 2, dtype=torch.int32)
    assert kern.moe_experts(x, gate_up, down, torch.empty(0, 2), ids, INTER).shape == (0, H)


@pytest.mark.parametrize("k, flags", [(2, 3), (8, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_ffn_routes_like_torch(kern, k, flags, dtype):
    """Router GEMM, softmax, top-k, renormalisation (flag 1) and rounding of the weights to the
    model dtype (flag 2) in C, against transformers' routing on the same router logits."""
    from cpud.ranks.layers.moe import route

    torch.manual_seed(k + flags)
    gate_up, gate_up_packed = stacked(2 * INTER, H)
    down, down_packed = stacked(H, INTER)
    router = native.pack_weight((torch.randn(E, H) / H**0.5).to(torch.bfloat16))
    x = torch.randn(33, H).to(dtype)
    out = kern.moe_ffn(x, router, gate_up_packed, down_packed, k, INTER, flags)
    logits = kern.gemm_packed(x, router)
    weights, ids = route(logits, k, bool(flags & 1), dtype if flags & 2 else torch.float32)
    expected = kern.moe_experts(x, gate_up_packed, down_packed, weights, ids, INTER)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("tokens, k", [(1, 2), (33, 8), (70, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_region_equals_a_gemm_per_expert(kern, tokens, k, dtype):
    """The experts' work list in one parallel region gives, bit for bit, what one packed GEMM
    call per routed expert (gate/up, silu * mul, down) and the combine give."""
    from cpud.native.kernels import PackedWeight

    torch.manual_seed(tokens + k)
    _, gate_up = stacked(2 * INTER, H)
    _, down = stacked(H, INTER)
    weights, ids = routing(tokens, k, seed=k)
    x = torch.randn(tokens, H).to(dtype)
    out = kern.moe_experts(x, gate_up, down, weights, ids, INTER)
    want = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        h = kern.gemm_packed(x[token], PackedWeight(gate_up[e], 2 * INTER, H))
        y = torch.empty(len(token), H)
        kern.gemm_packed(kern.silu_and_mul(h), PackedWeight(down[e], H, INTER), y)
        want.index_add_(0, token, (y.to(dtype) * weights[token, slot, None]).to(dtype))
    assert torch.equal(out, want)
