"""A sparse mixture-of-experts block: a router picks top-k experts per token, each expert is a
gated MLP, and the token's output is the routing-weighted sum of its experts' outputs; the
model's MoeRecipe picks the router, the biases and the activation (SiLU, gpt-oss's clamped
SwiGLU).

Experts are stacked per projection, gate_up [E, 2 I, H] and down [E, H, I], and sharded like the
dense MLP: each rank holds the slice [rank I / tp, (rank + 1) I / tp) of every expert's
intermediate dimension (column-parallel gate/up, row-parallel down), so one all-reduce per layer
sums the partial outputs. The router is replicated. On the native kernels the experts are bf16
stacks packed for the skinny GEMM, or a GGUF file's stacks kept in their blocks
(ranks/gguf_experts.py), and run in one native call (native/drivers/moe.c), which reads only
the experts a step routes to.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cpud.model.model_config import ModelConfig
from cpud.model.moe_recipe import MoeRecipe
from cpud.model.sizes import divide
from cpud.ranks.layers.base import Layer
from cpud.ranks.layers.linear import ReplicatedLinear, check_shape, load_whole, new_param
from cpud.ranks.ops import Ops
from cpud.ranks.parallel import TPGroup
from cpud.settings.errors import ConfigError

ALL = "all"  # the shard id's expert for a stack of every expert (GGUF's *_exps tensors)
# cpud_moe_flags (native/c_api/cpud_native.h)
RENORMALIZE = 1
WEIGHTS_IN_DTYPE = 2
SILU = MoeRecipe()


def route(
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    weights_dtype: torch.dtype,
    router: str = "softmax_topk",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in weights_dtype, expert ids [T, k] int32) from router logits [T, E]:
    softmax_topk: softmax in fp32, top-k, optionally renormalised over the chosen k;
    topk_softmax: top-k of the logits, softmax in fp32 over those k."""
    if router == "topk_softmax":
        top, ids = torch.topk(logits, top_k, dim=-1)
        weights = torch.softmax(top, dim=-1, dtype=torch.float32)
        return weights.to(weights_dtype), ids.to(torch.int32)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype), ids.to(torch.int32)


def activate(h: torch.Tensor, recipe: MoeRecipe) -> torch.Tensor:
    """[n, 2 I] gate | up -> [n, I] by the recipe's activation, in h's dtype."""
    inter = h.shape[-1] // 2
    gate, up = h[:, :inter], h[:, inter:]
    if recipe.activation == "silu":
        return F.silu(gate) * up
    limit = recipe.swiglu_limit
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * recipe.swiglu_alpha))


def experts_reference(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    recipe: MoeRecipe = SILU,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [T, H] = sum over each token's experts e of weight * down_e(act(gate_up_e x)), with
    the experts' biases when given, in x's dtype, experts added in ascending order (the
    numerics of transformers' modules)."""
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        h = F.linear(x[token], gate_up[e], None if gate_up_bias is None else gate_up_bias[e])
        h = activate(h, recipe)
        y = F.linear(h, down[e], None if down_bias is None else down_bias[e])
        out.index_add_(0, token, (y * weights[token, slot, None]).to(x.dtype))
    return out


class MoEExperts(Layer):
    """This rank's slices of every expert's gate/up and down projections (and their biases
    when the recipe has them)."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        dtype: torch.dtype,
        group: TPGroup,
        ops: Ops,
        recipe: MoeRecipe = SILU,
    ):
        super().__init__()
        self.group = group
        self.ops = ops
        self.recipe = recipe
        self.num_experts = num_experts
        self.hidden = hidden
        self.inter = divide(intermediate, group.size, "moe_intermediate_size")
        shape = (num_experts, 2 * self.inter, hidden)
        self.gate_up_proj = new_param(shape, dtype, self.load_gate_up)
        self.down_proj = new_param((num_experts, hidden, self.inter), dtype, self.load_down)
        self.gate_up_proj_bias: nn.Parameter | None = None
        self.down_proj_bias: nn.Parameter | None = None
        if recipe.expert_bias:
            bias_shape = (num_experts, 2 * self.inter)
            self.gate_up_proj_bias = new_param(bias_shape, dtype, self.load_gate_up_bias)
            self.down_proj_bias = new_param((num_experts, hidden), dtype, load_whole)
        self.packed: Any = None  # native: (gate_up [E, *packed], down [E, *packed]) bf16
        self._packing: tuple[torch.Tensor, torch.Tensor] | None = None  # filled while loading
        # Kept in GGUF blocks (ranks/gguf_experts.py): the plan while loading, then the
        # (gate_up, down) ExpertStacks the kernel runs.
        self.quant_plan: Any = None
        self.quant: Any = None
        self.quant_sources: dict[str, Any] = {}  # {"gate", "up", "down": GGUF source}

    def begin_pack(self) -> None:
        """From here on each expert's rows go from the checkpoint straight into the packed
        stacks; the plain stacks' pages are never touched.  Experts kept quantized stay so."""
        from cpud.native import packed_shape

        if self.quant_plan is not None:
            return
        shapes = (packed_shape(2 * self.inter, self.hidden), packed_shape(self.hidden, self.inter))
        self._packing = tuple(
            torch.zeros((self.num_experts, *shape), dtype=torch.bfloat16) for shape in shapes
        )

    def _store(self, which: int, param: nn.Parameter, expert: int, row0: int, rows: Any) -> None:
        dest = param.data[expert, row0 : row0 + rows.shape[0]]  # a view: no page is touched
        check_shape(tuple(dest.shape), rows, f"expert {expert} shard")
        if self._packing is None:
            dest.copy_(rows)
        else:
            from cpud.native import pack_rows

            pack_rows(self._packing[which][expert], row0, rows)

    def local_slice(self) -> slice:
        """This rank's range of the intermediate dimension."""
        return slice(self.group.rank * self.inter, (self.group.rank + 1) * self.inter)

    def load_gate_up(self, param: nn.Parameter, source: Any, shard_id: Any) -> None:
        """shard_id (expert, part): part 0 gate, 1 up of one expert's [I, H] tensor, or of a
        GGUF stack [E, I, H] of every expert when expert is ALL; None: the whole stack
        [E, 2 I, H] in cpud's layout (gate rows, then up rows)."""
        rows = self.local_slice()
        if shard_id is None:
            full = self.inter * self.group.size
            for e in range(self.num_experts):
                whole = source[e : e + 1][0]
                self._store(0, param, e, 0, whole[rows])
                self._store(0, param, e, self.inter, whole[full + rows.start : full + rows.stop])
            return
        expert, part = shard_id
        if expert != ALL:
            self._store(0, param, expert, part * self.inter, source[rows])
            return
        self._check_stack(source, self.inter * self.group.size, self.hidden)
        if self.quant_plan is not None:
            self.quant_sources[("gate", "up")[part]] = source
            return
        from cpud.ranks.gguf_blocks import expert_rows

        for e in range(self.num_experts):
            self._store(0, param, e, part * self.inter, expert_rows(source, e, rows))

    def load_down(self, param: nn.Parameter, source: Any, shard_id: Any) -> None:
        columns = self.local_slice()
        if shard_id is None:
            for e in range(self.num_experts):
                self._store(1, param, e, 0, source[e : e + 1][0][:, columns])
            return
        expert, _ = shard_id
        if expert != ALL:
            self._store(1, param, expert, 0, source[:, columns])
            return
        self._check_stack(source, self.hidden, self.inter * self.group.size)
        if self.quant_plan is not None:
            self.quant_sources["down"] = source
            return
        from cpud.ranks.gguf_blocks import expert_rows

        for e in range(self.num_experts):
            self._store(1, param, e, 0, expert_rows(source, e, slice(None), columns))

    def load_gate_up_bias(self, param: nn.Parameter, source: Any, shard_id: Any = None) -> None:
        """The whole [E, 2 I] bias (gate, then up); this rank keeps its slice of each half.
        shard_id (ALL, part): one half [E, I] (GGUF's ffn_gate_exps.bias / ffn_up_exps.bias)."""
        rows = self.local_slice()
        if shard_id is not None:
            part = shard_id[1]
            mine = source[:][:, rows]
            dest = param.data[:, part * self.inter : (part + 1) * self.inter]
            check_shape(tuple(dest.shape), mine, "experts.gate_up_proj_bias")
            dest.copy_(mine)
            return
        full = source[:]
        half = full.shape[-1] // 2
        mine = torch.cat([full[:, rows], full[:, half + rows.start : half + rows.stop]], dim=1)
        check_shape(tuple(param.shape), mine, "experts.gate_up_proj_bias")
        param.data.copy_(mine)

    def _check_stack(self, source: Any, rows: int, columns: int) -> None:
        want = [self.num_experts, rows, columns]
        if list(source.get_shape()) != want:
            raise ConfigError(
                f"expert stack has shape {source.get_shape()}, expected {want}: the file's "
                f"metadata does not match its tensors"
            )

    def finish_pack(self) -> None:
        """The packed stacks filled while loading replace the plain weights."""
        if self.quant_plan is not None:
            return
        self.packed, self._packing = self._packing, None
        self.gate_up_proj = None
        self.down_proj = None

    def stacks(self) -> Any:
        """(gate_up, down) ExpertStacks for the native kernel, or None (torch)."""
        if self.quant is not None:
            return self.quant
        if self.packed is None:
            return None
        from cpud.native.moe_kernels import ExpertStack

        gate_up, down = self.packed
        return (
            ExpertStack(2 * self.inter, self.hidden, gate_up),
            ExpertStack(self.hidden, self.inter, down),
        )

    def biases(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(gate_up bias, down bias) this rank adds: the down bias on rank 0 only, since the
        ranks' partial outputs are summed."""
        gate_up = None if self.gate_up_proj_bias is None else self.gate_up_proj_bias.data
        down = self.down_proj_bias
        return gate_up, (down.data if down is not None and self.group.rank == 0 else None)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum over the experts (not yet all-reduced)."""
        stacks = self.stacks()
        if stacks is not None:
            from cpud.native.moe_kernels import moe_routed

            return moe_routed(self.ops.k, x, *stacks, weights, ids, self.recipe, *self.biases())
        return experts_reference(
            x, self.gate_up_proj, self.down_proj, weights, ids, self.recipe, *self.biases()
        )


class SparseMoeBlock(Layer):
    """Router plus experts, one all-reduce; named like transformers' module (mlp.gate,
    mlp.experts) so checkpoint names map directly."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, group: TPGroup, ops: Ops):
        super().__init__()
        self.group = group
        self.recipe = cfg.moe_recipe
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = self.recipe.renormalize
        self.weights_in_dtype = self.recipe.weights_in_dtype
        self.gate = ReplicatedLinear(
            cfg.hidden_size, cfg.num_experts, self.recipe.router_bias, dtype
        )
        self.experts = MoEExperts(
            cfg.num_experts,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            dtype,
            group,
            ops,
            self.recipe,
        )
        self._native: Any = None  # native_moe's, once made
        self.shared_expert: Layer | None = None
        self.shared_expert_gate: ReplicatedLinear | None = None
        if cfg.shared_expert_intermediate_size:
            from cpud.ranks.models.decoder import GatedMLP

            shared = replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size)
            self.shared_expert = GatedMLP(shared, dtype, group, ops)
            self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1, False, dtype)

    def native_moe(self) -> Any:
        """The whole layer as one cpud_moe (native/moe_kernels.py MoeLayer: router, recipe,
        bf16 or quantized stacks, this rank's biases), made once; None off the native
        kernels or before the router is packed."""
        stacks = self.experts.stacks()
        if stacks is None or self.gate.packed is None:
            return None
        if self._native is None:
            from cpud.native.moe_kernels import MoeLayer

            self._native = MoeLayer(
                *stacks, self.top_k, self.recipe, *self.experts.biases(), self.gate.packed
            )
        return self._native

    @property
    def flags(self) -> int:
        """The routing as cpud_moe_flags."""
        return RENORMALIZE * self.renormalize + WEIGHTS_IN_DTYPE * self.weights_in_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        native = self.native_moe()
        if native is not None:
            from cpud.native.moe_kernels import run_layer

            out = run_layer(self.experts.ops.k, native, x.contiguous())
        else:
            logits = self.gate(x)
            dtype = x.dtype if self.weights_in_dtype else torch.float32
            router = self.recipe.router
            weights, ids = route(logits, self.top_k, self.renormalize, dtype, router)
            out = self.experts(x.contiguous(), weights, ids)
        out = self.group.all_reduce(out)
        if self.shared_expert is None:
            return out
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
