"""A sparse mixture-of-experts block: a router picks top-k experts per token, each expert is a
SwiGLU MLP, and the token's output is the routing-weighted sum of its experts' outputs.

Experts are stacked per projection, gate_up [E, 2 I, H] and down [E, H, I], and sharded like the
dense MLP: each rank holds the slice [rank I / tp, (rank + 1) I / tp) of every expert's
intermediate dimension (column-parallel gate/up, row-parallel down), so one all-reduce per layer
sums the partial outputs. The router is replicated. With bf16 weights on the native kernels the
experts are packed for the skinny GEMM and run in one native call (native/drivers/moe.c), which
reads only the experts a step routes to.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cpud.model.model_config import ModelConfig
from cpud.model.sizes import divide
from cpud.ranks.layers.base import Layer
from cpud.ranks.layers.linear import ReplicatedLinear, check_shape, new_param
from cpud.ranks.ops import Ops
from cpud.ranks.parallel import TPGroup
from cpud.settings.errors import ConfigError

ALL = "all"  # the shard id's expert for a stack of every expert (GGUF's *_exps tensors)
# cpud_moe_flags (native/c_api/cpud_native.h)
RENORMALIZE = 1
WEIGHTS_IN_DTYPE = 2


def route(
    logits: torch.Tensor, top_k: int, renormalize: bool, weights_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in weights_dtype, expert ids [T, k] int32) from router logits [T, E]:
    softmax in fp32, top-k, optionally renormalised over the chosen k."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype), ids.to(torch.int32)


def experts_reference(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """out [T, H] = sum over each token's experts e of weight * down_e(silu(gate_e x) * up_e x),
    in x's dtype, experts added in ascending order (the numerics of transformers' modules)."""
    out = torch.zeros_like(x)
    inter = gate_up.shape[1] // 2
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        h = F.linear(x[token], gate_up[e])
        h = F.silu(h[:, :inter]) * h[:, inter:]
        y = F.linear(h, down[e]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(x.dtype))
    return out


class MoEExperts(Layer):
    """This rank's slices of every expert's gate/up and down projections."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        dtype: torch.dtype,
        group: TPGroup,
        ops: Ops,
    ):
        super().__init__()
        self.group = group
        self.ops = ops
        self.num_experts = num_experts
        self.hidden = hidden
        self.inter = divide(intermediate, group.size, "moe_intermediate_size")
        shape = (num_experts, 2 * self.inter, hidden)
        self.gate_up_proj = new_param(shape, dtype, self.load_gate_up)
        self.down_proj = new_param((num_experts, hidden, self.inter), dtype, self.load_down)
        self.packed: Any = None  # native: (gate_up [E, *packed], down [E, *packed]) bf16
        self._packing: tuple[torch.Tensor, torch.Tensor] | None = None  # filled while loading

    def begin_pack(self) -> None:
        """From here on each expert's rows go from the checkpoint straight into the packed
        stacks; the plain stacks' pages are never touched."""
        from cpud.native import packed_shape

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

    def load_gate_up(self, param: nn.Parameter, source: Any, shard_id: Any) -> None:
        """shard_id (expert, part): part 0 gate, 1 up of one expert's [I, H] tensor, or of a
        GGUF stack [E, I, H] of every expert when expert is ALL."""
        expert, part = shard_id
        rows = slice(self.group.rank * self.inter, (self.group.rank + 1) * self.inter)
        if expert != ALL:
            self._store(0, param, expert, part * self.inter, source[rows])
            return
        from cpud.ranks.gguf_experts import expert_rows

        self._check_stack(source, self.inter * self.group.size, self.hidden)
        for e in range(self.num_experts):
            self._store(0, param, e, part * self.inter, expert_rows(source, e, rows))

    def load_down(self, param: nn.Parameter, source: Any, shard_id: Any) -> None:
        expert, _ = shard_id
        columns = slice(self.group.rank * self.inter, (self.group.rank + 1) * self.inter)
        if expert != ALL:
            self._store(1, param, expert, 0, source[:, columns])
            return
        from cpud.ranks.gguf_experts import expert_rows

        self._check_stack(source, self.hidden, self.inter * self.group.size)
        for e in range(self.num_experts):
            self._store(1, param, e, 0, expert_rows(source, e, slice(None), columns))

    def _check_stack(self, source: Any, rows: int, columns: int) -> None:
        want = [self.num_experts, rows, columns]
        if list(source.get_shape()) != want:
            raise ConfigError(
                f"expert stack has shape {source.get_shape()}, expected {want}: the file's "
                f"metadata does not match its tensors"
            )

    def finish_pack(self) -> None:
        """The packed stacks filled while loading replace the plain weights."""
        self.packed, self._packing = self._packing, None
        self.gate_up_proj = None
        self.down_proj = None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum over the experts (not yet all-reduced)."""
        if self.packed is not None:
            gate_up, down = self.packed
            return self.ops.k.moe_experts(x, gate_up, down, weights, ids, self.inter)
        return experts_reference(x, self.gate_up_proj, self.down_proj, weights, ids)


class SparseMoeBlock(Layer):
    """Router plus experts, one all-reduce; named like transformers' module (mlp.gate,
    mlp.experts) so checkpoint names map directly."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, group: TPGroup, ops: Ops):
        super().__init__()
        self.group = group
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.weights_in_dtype = cfg.router_weights_in_dtype
        self.gate = ReplicatedLinear(cfg.hidden_size, cfg.num_experts, False, dtype)
        self.experts = MoEExperts(
            cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype, group, ops
        )
        self.shared_expert: Layer | None = None
        self.shared_expert_gate: ReplicatedLinear | None = None
        if cfg.shared_expert_intermediate_size:
            from cpud.ranks.models.decoder import GatedMLP

            shared = replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size)
            self.shared_expert = GatedMLP(shared, dtype, group, ops)
            self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1, False, dtype)

    @property
    def flags(self) -> int:
        """The routing as cpud_moe_flags."""
        return RENORMALIZE * self.renormalize + WEIGHTS_IN_DTYPE * self.weights_in_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts = self.experts
        if experts.packed is not None and self.gate.packed is not None:
            gate_up, down = experts.packed
            out = experts.ops.k.moe_ffn(
                x.contiguous(),
                self.gate.packed,
                gate_up,
                down,
                self.top_k,
                experts.inter,
                self.flags,
            )
        else:
            logits = self.gate(x)
            dtype = x.dtype if self.weights_in_dtype else torch.float32
            weights, ids = route(logits, self.top_k, self.renormalize, dtype)
            out = self.experts(x, weights, ids)
        out = self.group.all_reduce(out)
        if self.shared_expert is None:
            return out
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
