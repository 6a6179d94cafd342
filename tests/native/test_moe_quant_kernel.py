"""The native expert kernel on quantized stacks (native/drivers/moe.c, native/moe_kernels.py),
every kernel format on every quantized-GEMM variant this CPU runs; and the MoE recipe's math
(router variants, expert biases, clamped SwiGLU) on bf16 and quantized stacks.

Two references.  Composed: each routed expert through the dense quantized GEMM (quant_gemm,
the same int8 tiles, x quantized the same way per row), the activation and the combine in torch
as transformers adds experts: the fused kernel must equal it to fp32 rounding (a row's result
does not depend on the rows beside it).  Float: the torch reference (experts_reference) in fp64
on the dequantized weights: x and the activations rounded to int8 blocks move each output by
about 1 % of its scale, so the relative error over the output is bounded by 3 %."""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from cpud import native
from cpud.model.moe_recipe import MoeRecipe
from cpud.native import quant
from cpud.native.moe_kernels import ExpertStack, expert_weight, moe_layer, moe_routed, quant_stack
from cpud.ranks.layers.moe import experts_reference, route

TIERS = native.supported_isas()
VARIANTS = (
    [("scalar", True)]
    + [(isa, v) for isa in ("avx2", "avx512") if isa in TIERS for v in (False, True)]
    + [("amx", True)] * ("amx" in TIERS)
)
E, H, INTER = 10, 256, 256
EMPTY, SINGLE = 3, 5  # expert 3 gets no token, expert 5 exactly one
GGUF_QUANTIZES = ("Q8_0", "Q4_0", "Q4_1", "MXFP4")
SILU = MoeRecipe()


def routing(tokens: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = random.Random(seed)
    pool = [e for e in range(E) if e not in (EMPTY, SINGLE)]
    ids = [rng.sample(pool, k) for _ in range(tokens)]
    if tokens:
        ids[0][-1] = SINGLE
    weights = torch.rand(tokens, k, generator=torch.Generator().manual_seed(seed))
    return weights / weights.sum(-1, keepdim=True), torch.tensor(ids, dtype=torch.int32)


def raw_rows(name: str, n: int, k: int, seed: int) -> np.ndarray:
    """GGUF rows [n, bytes]: gguf-quantized Gaussians, or for the K-quants (gguf cannot write
    them) random bytes with small positive scales, which is every valid block."""
    rng = np.random.default_rng(seed)
    fmt = quant.KERNEL_FORMATS[name]
    if name in GGUF_QUANTIZES:
        return quants.quantize((rng.standard_normal((n, k)) / 4).astype(np.float32), T[name])
    blk = rng.integers(0, 256, (n, k // fmt.block_values, fmt.block_bytes), dtype=np.uint8)
    scale = (rng.random((n, k // fmt.block_values, 2)) * 0.002 + 2e-4).astype(np.float16)
    if name == "Q6_K":
        blk[..., 208:210] = scale.view(np.uint8)[..., :2]
    else:
        blk[..., 0:4] = scale.view(np.uint8)
    return blk.reshape(n, -1)


@functools.cache
def stacks(
    gate_up_type: str, down_type: str
) -> tuple[ExpertStack, ExpertStack, torch.Tensor, torch.Tensor]:
    """(gate_up stack, down stack, their dequantized weights [E, 2I, H] and [E, H, I] fp64)."""
    gu = [raw_rows(gate_up_type, 2 * INTER, H, e) for e in range(E)]
    dn = [raw_rows(down_type, H, INTER, 100 + e) for e in range(E)]

    def dense(raws: list[np.ndarray], qtype: str, n: int, k: int) -> torch.Tensor:
        values = [quants.dequantize(r, T[qtype]).reshape(n, k) for r in raws]
        return torch.from_numpy(np.stack(values).astype(np.float64))

    return (
        quant_stack(gu, gate_up_type, 2 * INTER, H),
        quant_stack(dn, down_type, H, INTER),
        dense(gu, gate_up_type, 2 * INTER, H),
        dense(dn, down_type, H, INTER),
    )


def composed(x, gate_up, down, weights, ids, isa, vnni) -> torch.Tensor:
    """Each routed expert through quant_gemm, silu * mul and the combine, in x's dtype."""
    kern = native.Kernels(isa)
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        h = quant.quant_gemm(x[token], expert_weight(gate_up, e), isa=isa, vnni=vnni)
        act = kern.silu_and_mul(h)
        y = torch.empty(len(token), H)
        quant.quant_gemm(act, expert_weight(down, e), y, isa=isa, vnni=vnni)
        out.index_add_(0, token, (y.to(x.dtype) * weights[token, slot, None]).to(x.dtype))
    return out


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


@pytest.mark.parametrize("isa, vnni", VARIANTS)
@pytest.mark.parametrize("name", list(quant.KERNEL_FORMATS))
@pytest.mark.parametrize("tokens, k", [(1, 1), (3, 2), (40, 4), (70, 8)])
def test_quantized_experts_match_references(isa, vnni, name, tokens, k):
    gate_up, down, gate_up_w, down_w = stacks(name, name)
    weights, ids = routing(tokens, k, seed=tokens + k)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(k))
    flags = 0 if vnni else quant.NO_VNNI
    kern = native.Kernels(isa)
    out = moe_routed(kern, x, gate_up, down, weights, ids, SILU, quant_flags=flags)
    assert out.shape == (tokens, H) and out.dtype == torch.float32
    torch.testing.assert_close(
        out, composed(x, gate_up, down, weights, ids, isa, vnni), rtol=1e-5, atol=1e-5
    )
    ref = experts_reference(x.double(), gate_up_w, down_w, weights.double(), ids)
    assert relative_error(out, ref) < 0.03


@pytest.mark.parametrize("isa", TIERS)
def test_quantized_experts_bf16_mixed_types_and_isolation(isa):
    """bf16 activations, Q4_K gate/up with Q6_K down (a Q4_K_M layer): the composed result in
    bf16 steps; a token's output does not depend on the other tokens of the step."""
    gate_up, down, gate_up_w, down_w = stacks("Q4_K", "Q6_K")
    weights, ids = routing(33, 8, seed=1)
    x = torch.randn(33, H).to(torch.bfloat16)
    kern = native.Kernels(isa)
    out = moe_routed(kern, x, gate_up, down, weights, ids, SILU)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(
        out, composed(x, gate_up, down, weights, ids, isa, True), rtol=1e-2, atol=1e-2
    )
    ref = experts_reference(x.double(), gate_up_w, down_w, weights.double(), ids)
    assert relative_error(out, ref) < 0.03
    alone = moe_routed(kern, x[7:8], gate_up, down, weights[7:8], ids[7:8], SILU)
    assert torch.equal(alone, out[7:8])


def test_quantized_experts_no_tokens_and_errors():
    gate_up, down, _, _ = stacks("Q8_0", "Q8_0")
    kern = native.Kernels()
    empty = torch.empty(0, 2, dtype=torch.int32)
    out = moe_routed(kern, torch.empty(0, H), gate_up, down, torch.empty(0, 2), empty, SILU)
    assert out.shape == (0, H)
    ids = torch.tensor([[0], [E]], dtype=torch.int32)
    with pytest.raises(Exception, match="expert id out of range"):
        moe_routed(kern, torch.randn(2, H), gate_up, down, torch.ones(2, 1), ids, SILU)
    with pytest.raises(ValueError, match="gate_up"):
        moe_routed(kern, torch.randn(1, H), down, down, torch.ones(1, 1), ids[:1], SILU)


def bf16_stacks(seed: int) -> tuple[ExpertStack, ExpertStack, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(E, 2 * INTER, H, generator=g) / H**0.5).to(torch.bfloat16)
    down = (torch.randn(E, H, INTER, generator=g) / INTER**0.5).to(torch.bfloat16)

    def packed(w: torch.Tensor) -> torch.Tensor:
        return torch.stack([native.pack_weight(w[e], huge_pages=False).data for e in range(E)])

    return (
        ExpertStack(2 * INTER, H, packed(gate_up)),
        ExpertStack(H, INTER, packed(down)),
        gate_up,
        down,
    )


GPT_OSS = MoeRecipe(
    router="topk_softmax",
    weights_in_dtype=True,
    router_bias=True,
    expert_bias=True,
    activation="swiglu_oai",
    swiglu_limit=1.5,
)


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_recipe_matches_torch(kern, quantized, dtype):
    """Router with bias, top-k of the raw logits then softmax, expert biases and the clamped
    SwiGLU (a limit the activations cross), in C against the torch reference."""
    if quantized:
        gate_up, down, gate_up_w, down_w = stacks("Q8_0", "Q8_0")
    else:
        gate_up, down, gate_up_w, down_w = bf16_stacks(3)
    g = torch.Generator().manual_seed(7)
    gate_up_bias = torch.randn(E, 2 * INTER, generator=g).to(dtype)
    down_bias = torch.randn(E, H, generator=g).to(dtype)
    router_w = (torch.randn(E, H, generator=g) / H**0.5).to(torch.bfloat16)
    router = native.pack_weight(router_w, torch.randn(E, generator=g).to(dtype))
    x = torch.randn(21, H, generator=g).to(dtype)
    out = moe_layer(kern, x, router, gate_up, down, 4, GPT_OSS, gate_up_bias, down_bias)
    logits = kern.gemm_packed(x, router)
    weights, ids = route(logits, 4, False, dtype, "topk_softmax")
    assert torch.allclose(weights.float().sum(-1), torch.ones(21), atol=1e-2)
    ref = experts_reference(
        x.double(), gate_up_w.double(), down_w.double(), weights.double(), ids, GPT_OSS,
        gate_up_bias.double(), down_bias.double(),
    )  # fmt: skip
    bound = 0.03 if quantized or dtype == torch.bfloat16 else 1e-4
    if kern.isa in ("avx512bf16", "amx") and not quantized:
        bound = 0.03  # bf16 tiers round x and the activations to bf16
    assert relative_error(out, ref) < bound
    routed = moe_routed(kern, x, gate_up, down, weights, ids, GPT_OSS, gate_up_bias, down_bias)
    torch.testing.assert_close(routed, out, rtol=1e-2, atol=1e-2)


def test_route_variants():
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0]])
    w, ids = route(logits, 2, False, torch.float32, "topk_softmax")
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(w, torch.softmax(torch.tensor([[3.0, 2.0]]), -1))
    w, ids = route(logits, 2, False, torch.float32)
    assert ids.tolist() == [[1, 2]] and float(w.sum()) < 0.95
    w, _ = route(logits, 2, True, torch.float32)
    torch.testing.assert_close(w.sum(-1), torch.ones(1))


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_one_token_same_bits_on_every_work_split(kern, k):
    """One token (an expert per row): with two experts or more per thread the kernel runs whole
    experts as work items, else each thread's share of the columns; both give the composed
    result, and the same bits at 1, 2 and 3 threads (Q4_K gate/up, Q6_K down, bf16)."""
    gate_up, down, _, _ = stacks("Q4_K", "Q6_K")
    weights, ids = routing(1, k, seed=k)
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(moe_routed(kern, x, gate_up, down, weights, ids, SILU))
    finally:
        torch.set_num_threads(threads)
    want = composed(x, gate_up, down, weights, ids, kern.isa, True)
    torch.testing.assert_close(outs[0], want, rtol=1e-2, atol=1e-2)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
