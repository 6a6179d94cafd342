"""The native expert layer (native/drivers/moe.c) on stacked expert weights, as its MoeRecipe
says: bf16 stacks packed for the skinny GEMM, or stacks kept in their GGUF blocks (every expert
laid out as ``pack_quantized`` lays it out) that run on the int8 kernels in one parallel region.

    gate_up = quant_stack(raws, "Q4_K", 2 * inter, hidden)   # raws: [n, bytes] rows per expert
    out = moe_routed(kernels, x, gate_up, down, weights, ids, recipe)
    out = moe_layer(kernels, x, router, gate_up, down, top_k, recipe)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cpud.model.moe_recipe import MoeRecipe

from . import _loader
from .hugepages import huge_empty
from .kernels import Kernels, PackedWeight, _contig, _dtype, check_rc, packed_shape
from .quant import QuantWeight, pack_rows_into, qtype_name
from .quant_formats import KERNEL_FORMATS

RENORMALIZE = 1  # cpud_moe_flags
WEIGHTS_IN_DTYPE = 2
ROUTERS = {"softmax_topk": 0, "topk_softmax": 1}  # cpud_moe_router
ACTIVATIONS = {"silu": 0, "swiglu_oai": 1}  # cpud_moe_activation


@dataclass(frozen=True)
class ExpertStack:
    """One projection W_e [n, k] of every expert: bf16 packed (qtype None, data
    [E, *packed_shape(n, k)]) or quantized (data: the quants [E, groups, k / bs, qbytes] u8,
    scales [E, groups, k / bs, sbytes] u8, each expert as ``pack_quantized`` lays it out)."""

    n: int
    k: int
    data: torch.Tensor
    qtype: str | None = None
    scales: torch.Tensor | None = None

    @property
    def experts(self) -> int:
        return self.data.shape[0]

    @property
    def weight_bytes(self) -> int:
        """Bytes of every expert's weights (padding rows included)."""
        extra = 0 if self.scales is None else self.scales.numel()
        return self.data.numel() * self.data.element_size() + extra

    def check(self, experts: int, n: int, k: int, name: str) -> None:
        """ValueError unless this is a stack of `experts` [n, k] weights the kernel can read."""
        if self.qtype is None:
            _contig(self.data, name, torch.bfloat16, (experts, *packed_shape(n, k)))
            return
        fmt = KERNEL_FORMATS[self.qtype]
        shape = (experts, -(-n // 16), k // fmt.block_values)
        good = (
            (self.n, self.k) == (n, k)
            and k % fmt.block_values == 0
            and self.scales is not None
            and tuple(self.data.shape) == (*shape, fmt.qbytes)
            and tuple(self.scales.shape) == (*shape, fmt.sbytes)
            and self.data.is_contiguous()
            and self.scales.is_contiguous()
            and self.data.data_ptr() % 64 == 0
        )
        if not good:
            raise ValueError(f"{name}: not a {self.qtype} stack of {experts} [{n}, {k}] experts")


def quant_stack_shapes(qtype: str, experts: int, n: int, k: int) -> tuple[tuple[int, ...], ...]:
    """Shapes of a quantized stack's (quants, scales)."""
    fmt = KERNEL_FORMATS[qtype_name(qtype)]
    shape = (experts, -(-n // 16), k // fmt.block_values)
    return (*shape, fmt.qbytes), (*shape, fmt.sbytes)


Rows = np.ndarray | torch.Tensor


def quant_stack(
    raws: Sequence[Rows | Sequence[Rows]] | Callable[[int], Rows | Sequence[Rows]],
    qtype: Any,
    n: int,
    k: int,
    experts: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> ExpertStack:
    """Repacks each expert's GGUF rows (raws[e] or raws(e): [n, bytes per row] u8, or parts
    of them stacked in order, e.g. views of the gate rows and the up rows in the mapped file)
    into one stack, in one native call, on huge pages unless `out` gives the (quants, scales)
    tensors to fill."""
    name = qtype_name(qtype)
    count = len(raws) if experts is None else experts
    get = raws if callable(raws) else raws.__getitem__
    if out is None:
        qs_shape, sc_shape = quant_stack_shapes(name, count, n, k)
        out = huge_empty(qs_shape, torch.uint8), huge_empty(sc_shape, torch.uint8)
    qs, sc = out
    sources = []
    for e in range(count):
        rows = get(e)
        sources.append([rows] if isinstance(rows, (np.ndarray, torch.Tensor)) else list(rows))
    pack_rows_into(sources, name, n, k, qs, sc)
    return ExpertStack(n, k, qs, name, sc)


def expert_weight(stack: ExpertStack, e: int) -> QuantWeight:
    """Expert e of a quantized stack as a QuantWeight (tests: the dense GEMM on one expert)."""
    assert stack.qtype is not None and stack.scales is not None
    return QuantWeight(stack.qtype, stack.n, stack.k, stack.data[e], stack.scales[e])


def _f32(t: torch.Tensor | None, shape: tuple[int, ...], name: str) -> torch.Tensor | None:
    if t is None:
        return None
    t = t.detach().to(torch.float32).contiguous()
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    return t


class MoeLayer:
    """A cpud_moe struct and the tensors it points into (kept alive with it)."""

    def __init__(
        self,
        gate_up: ExpertStack,
        down: ExpertStack,
        top_k: int,
        recipe: MoeRecipe,
        gate_up_bias: torch.Tensor | None,
        down_bias: torch.Tensor | None,
        router: PackedWeight | None = None,
        quant_flags: int = 0,
    ):
        experts, inter, hidden = gate_up.experts, down.k, down.n
        gate_up.check(experts, 2 * inter, hidden, "gate_up")
        down.check(experts, hidden, inter, "down")
        if (gate_up.qtype is None) != (down.qtype is None):
            raise ValueError("gate_up and down: both bf16 or both quantized")
        self.keep = [
            _f32(gate_up_bias, (experts, 2 * inter), "gate_up_bias"),
            _f32(down_bias, (experts, hidden), "down_bias"),
        ]
        m = _loader.ffi.new("cpud_moe *")
        m.E, m.k, m.H, m.I = experts, top_k, hidden, inter
        m.flags = RENORMALIZE * recipe.renormalize + WEIGHTS_IN_DTYPE * recipe.weights_in_dtype
        m.router_kind, m.activation = ROUTERS[recipe.router], ACTIVATIONS[recipe.activation]
        m.swiglu_alpha, m.swiglu_limit = recipe.swiglu_alpha, recipe.swiglu_limit
        m.quant_flags = quant_flags
        if router is not None:
            if (router.n, router.k) != (experts, hidden):
                raise ValueError(f"router: {router.n} x {router.k}, expected {experts} x {hidden}")
            m.router = router.data.data_ptr()
            m.router_bias = 0 if router.bias is None else router.bias.data_ptr()
            self.keep.append(router.bias)
        for prefix, stack in (("gate_up", gate_up), ("down", down)):
            code = -1 if stack.qtype is None else KERNEL_FORMATS[stack.qtype].code
            setattr(m, f"{prefix}_qtype", code)
            setattr(m, prefix, stack.data.data_ptr())
            setattr(m, f"{prefix}_sc", 0 if stack.scales is None else stack.scales.data_ptr())
        m.gate_up_bias = 0 if self.keep[0] is None else self.keep[0].data_ptr()
        m.down_bias = 0 if self.keep[1] is None else self.keep[1].data_ptr()
        self.struct = m

    @property
    def address(self) -> int:
        """The cpud_moe's address (cpud_decoder_layer.moe); valid while this object lives."""
        return int(_loader.ffi.cast("intptr_t", self.struct))


def moe_routed(
    kernels: Kernels,
    x: torch.Tensor,
    gate_up: ExpertStack,
    down: ExpertStack,
    weights: torch.Tensor,
    ids: torch.Tensor,
    recipe: MoeRecipe,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    quant_flags: int = 0,
) -> torch.Tensor:
    """out [T, H] (x's dtype) = sum over each token's experts ids[t] of weights[t] * expert(x)
    as the recipe's activation and biases say (the router parts of the recipe unused)."""
    tokens, hidden = x.shape
    k = ids.shape[-1]
    layer = MoeLayer(gate_up, down, k, recipe, gate_up_bias, down_bias, quant_flags=quant_flags)
    _contig(x, "x", x.dtype, (None, hidden))
    _contig(ids, "ids", torch.int32, (tokens, k))
    weights = weights.to(torch.float32).contiguous()
    _contig(weights, "weights", torch.float32, (tokens, k))
    out = torch.empty_like(x)
    rc = _loader.lib.cpud_moe_routed(
        kernels._code, _dtype(x, "x"), layer.struct, x.data_ptr(), tokens, weights.data_ptr(),
        ids.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    check_rc(rc, "moe_routed", "an expert id out of range?")
    return out


def moe_layer(
    kernels: Kernels,
    x: torch.Tensor,
    router: PackedWeight,
    gate_up: ExpertStack,
    down: ExpertStack,
    top_k: int,
    recipe: MoeRecipe,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    quant_flags: int = 0,
) -> torch.Tensor:
    """The expert layer on x [T, H]: router logits (+ the router's bias), routing and
    ``moe_routed`` in one native call."""
    layer = MoeLayer(gate_up, down, top_k, recipe, gate_up_bias, down_bias, router, quant_flags)
    return run_layer(kernels, layer, x)


def run_layer(kernels: Kernels, layer: MoeLayer, x: torch.Tensor) -> torch.Tensor:
    """``moe_layer`` on a MoeLayer made once (x [T, H] contiguous)."""
    _contig(x, "x", x.dtype, (None, int(layer.struct.H)))
    out = torch.empty_like(x)
    rc = _loader.lib.cpud_moe_layer(
        kernels._code, _dtype(x, "x"), layer.struct, x.data_ptr(), x.shape[0], out.data_ptr()
    )
    check_rc(rc, "moe_layer")
    return out


__all__ = [
    "ExpertStack",
    "MoeLayer",
    "expert_weight",
    "moe_layer",
    "moe_routed",
    "quant_stack",
    "quant_stack_shapes",
    "run_layer",
]
