"""Megatron-style linear layers: each rank holds and loads only its slice of the weight.

Every parameter carries a `weight_loader(param, source, shard_id=None)` where `source` is a
safetensors slice (or a tensor) holding the *full* checkpoint tensor; the loader reads only
the rows or columns this rank owns.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cpud.model.sizes import divide
from cpud.ranks.layers.base import Layer
from cpud.ranks.parallel import TPGroup
from cpud.settings.errors import ConfigError


def source_shape(source: Any) -> tuple[int, ...]:
    return tuple(source.get_shape()) if hasattr(source, "get_shape") else tuple(source.shape)


def check_shape(dest_shape: tuple[int, ...], loaded: torch.Tensor, name: str) -> None:
    if tuple(dest_shape) != tuple(loaded.shape):
        raise ConfigError(
            f"checkpoint tensor for {name} has shape {tuple(loaded.shape)}, "
            f"expected {tuple(dest_shape)}: config.json does not match the weights"
        )


def copy_checked(dest: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    check_shape(tuple(dest.shape), loaded, name)
    dest.copy_(loaded)


def new_param(shape: tuple[int, ...], dtype: torch.dtype, loader: Any) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader
    return param


def load_whole(param: nn.Parameter, source: Any, shard_id: Any = None) -> None:
    copy_checked(param.data, source[:], "a replicated tensor")


class PackableLinear(Layer):
    """A linear layer whose weight can be packed for the native skinny GEMM while it loads:
    between ``begin_pack`` and ``finish_pack`` the weight's rows go from the checkpoint straight
    into the packed layout, so the plain [N, K] weight is never written (its pages never
    touched) and is dropped at the end; the bytes are held once."""

    packed: Any = None
    _kernels: Any = None
    _packing: torch.Tensor | None = None  # packed storage being filled while loading
    # Kept in GGUF blocks (ranks/quant_linear.py): the plan while loading, then the
    # (first output row, QuantWeight) parts the GEMM runs.
    quant_plan: Any = None
    quant: Any = None
    quant_blocks: Any = None  # {first local row: Blocks} while loading
    out_rows = 0  # local output features of a quantized layer

    def block_region(self, shard_id: Any) -> tuple[int, slice, slice]:
        """(first local row, source rows, source columns) of the shard a checkpoint tensor
        gives this rank."""
        return 0, slice(None), slice(None)

    def begin_pack(self, kernels: Any, packed: torch.Tensor | None = None) -> None:
        """From here on the weight is packed; `packed`: its packed data, already filled (from the
        weight cache), else fresh storage that loading fills."""
        from cpud.native import empty_packed

        self._packing = empty_packed(*self.weight.shape) if packed is None else packed
        self._kernels = kernels

    def store_rows(self, param: nn.Parameter, row0: int, loaded: torch.Tensor, name: str) -> None:
        """Rows [row0, row0 + len(loaded)) of param from a checkpoint tensor."""
        dest = param.data[row0 : row0 + loaded.shape[0]]  # a view: no page is touched
        if param is self.weight and self._packing is not None:
            from cpud.native import pack_rows

            check_shape(tuple(dest.shape), loaded, name)
            pack_rows(self._packing, row0, loaded)
        else:
            copy_checked(dest, loaded, name)

    def finish_pack(self, with_bias: bool) -> None:
        from cpud.native import packed_with_bias

        n, k = self.weight.shape
        bias = self.bias.data if with_bias and self.bias is not None else None
        self.packed = packed_with_bias(self._packing, n, k, bias)
        self._packing = None
        self.weight = None
        if with_bias:
            self.bias = None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant is not None:
            from cpud.ranks.quant_compute import quant_matmul

            return quant_matmul(x, self.quant, self.out_rows)
        if self.packed is not None:
            return self._kernels.gemm_packed(x, self.packed)
        return F.linear(x, self.weight, bias)


class ReplicatedLinear(PackableLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = new_param((out_features, in_features), dtype, self.load_replicated)
        self.bias = new_param((out_features,), dtype, load_whole) if bias else None

    def load_replicated(self, param: nn.Parameter, source: Any, shard_id: Any = None) -> None:
        self.store_rows(param, 0, source[:], "a replicated tensor")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ColumnParallelLinear(PackableLinear):
    """Output features split across ranks; no communication."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool,
        dtype: torch.dtype,
        group: TPGroup,
    ):
        super().__init__()
        self.group = group
        self.local_sizes = [divide(size, group.size, "output features") for size in output_sizes]
        self.offsets = [sum(self.local_sizes[:i]) for i in range(len(self.local_sizes))]
        self.checkpoint_sizes = list(output_sizes)  # rows of each part in a checkpoint
        out_local = sum(self.local_sizes)
        self.weight = new_param((out_local, in_features), dtype, self.load_shard)
        self.bias = new_param((out_local,), dtype, self.load_shard) if bias else None

    def shard_rows(self, shard_id: Any) -> tuple[int, int, int]:
        """(offset in the local param, first source row, row count) for a shard."""
        index = 0 if shard_id is None else int(shard_id)
        size = self.local_sizes[index]
        return self.offsets[index], self.group.rank * size, size

    def block_region(self, shard_id: Any) -> tuple[int, slice, slice]:
        offset, start, size = self.shard_rows(shard_id)
        return offset, slice(start, start + size), slice(None)

    def part_index(self, shard_id: Any) -> int:
        return 0 if shard_id is None else int(shard_id)

    def part_rows(self, shard_ids: tuple[Any, ...]) -> list[int]:
        """Rows each part takes in a checkpoint tensor that stacks them (Phi-3's fused ones)."""
        return [self.checkpoint_sizes[self.part_index(s)] for s in shard_ids]

    def load_shard(self, param: nn.Parameter, source: Any, shard_id: Any = None) -> None:
        offset, start, size = self.shard_rows(shard_id)
        self.store_rows(param, offset, source[start : start + size], "column shard")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; KV heads are replicated when tp exceeds their count."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        dtype: torch.dtype,
        group: TPGroup,
    ):
        tp = group.size
        self.num_heads_local = divide(num_heads, tp, "num_attention_heads")
        if num_kv_heads >= tp:
            self.num_kv_heads_local = divide(num_kv_heads, tp, "num_key_value_heads")
        else:
            divide(tp, num_kv_heads, "tp over num_key_value_heads")
            self.num_kv_heads_local = 1
        self.head_dim = head_dim
        self.kv_replicas = max(1, tp // num_kv_heads)
        q_size = self.num_heads_local * head_dim
        kv_size = self.num_kv_heads_local * head_dim
        super().__init__(hidden_size, [q_size * tp, kv_size * tp, kv_size * tp], bias, dtype, group)
        kv_rows = num_kv_heads * head_dim
        self.checkpoint_sizes = [num_heads * head_dim, kv_rows, kv_rows]

    def part_index(self, shard_id: Any) -> int:
        return {"q": 0, "k": 1, "v": 2}[shard_id]

    def shard_rows(self, shard_id: Any) -> tuple[int, int, int]:
        index = {"q": 0, "k": 1, "v": 2}[shard_id]
        size = self.local_sizes[index]
        owner = self.group.rank if index == 0 else self.group.rank // self.kv_replicas
        return self.offsets[index], owner * size, size

    @property
    def q_size(self) -> int:
        return self.local_sizes[0]

    @property
    def kv_size(self) -> int:
        return self.local_sizes[1]


class RowParallelLinear(PackableLinear):
    """Input features split across ranks; partial outputs summed by one all-reduce."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, group: TPGroup
    ):
        super().__init__()
        self.group = group
        self.in_local = divide(in_features, group.size, "input features")
        self.weight = new_param((out_features, self.in_local), dtype, self.load_columns)
        self.bias = new_param((out_features,), dtype, load_whole) if bias else None

    def block_region(self, shard_id: Any) -> tuple[int, slice, slice]:
        start = self.group.rank * self.in_local
        return 0, slice(None), slice(start, start + self.in_local)

    def load_columns(self, param: nn.Parameter, source: Any, shard_id: Any = None) -> None:
        start = self.group.rank * self.in_local
        self.store_rows(param, 0, source[:, start : start + self.in_local], "row shard")

    def finish_pack(self, with_bias: bool = False) -> None:
        super().finish_pack(with_bias=False)  # the bias is added once, after the all-reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.all_reduce(self.matmul(x, None))
        return out if self.bias is None else out + self.bias
