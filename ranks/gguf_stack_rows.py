"""A range of rows of every expert of a GGUF expert stack, read as a stack of its own: the gate
and up halves of a fused `blk.N.ffn_gate_up_exps` [E, 2 I, H] (gate rows, then up rows, as
llama.cpp's converter writes it under --fuse-gate-up-exps), which then load like the separate
ffn_gate_exps / ffn_up_exps stacks: kept in their blocks (ranks/gguf_experts.py) or dense,
each rank taking its range of the intermediate dimension of each half. No bytes are copied.
A fused stack's bias `blk.N.ffn_gate_up_exps.bias` [E, 2 I] splits the same way, into the
halves the separate ffn_gate_exps.bias / ffn_up_exps.bias would be."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from cpud.ranks.models.expert_views import ALL


@dataclass(frozen=True)
class StackTensor:
    """What the GGUF expert readers (ranks/gguf_blocks.py expert_blocks) read of a gguf
    ReaderTensor: its name, type, GGUF-order shape and [experts, rows, row bytes] data."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # GGUF order: (columns, rows, experts)
    data: np.ndarray  # [experts, rows, bytes per row] uint8


class StackRows:
    """Rows [row0, row0 + rows) of every expert of `source` (a GGUF loader's TensorSource over
    an expert stack), read like one: `get_shape()`, `tensor`, `dtype`."""

    def __init__(self, source: Any, row0: int, rows: int):
        tensor = source.tensor
        columns, n_rows, experts = (int(d) for d in tensor.shape)
        if row0 < 0 or rows < 1 or row0 + rows > n_rows:
            raise ValueError(f"{tensor.name}: rows {row0}..{row0 + rows} of {n_rows}")
        data = tensor.data.view(np.uint8).reshape(experts, n_rows, -1)[:, row0 : row0 + rows]
        shape = np.array([columns, rows, experts])
        self.tensor = StackTensor(tensor.name, tensor.tensor_type, shape, data)
        self.dtype = source.dtype

    def get_shape(self) -> list[int]:
        columns, rows, experts = (int(d) for d in self.tensor.shape)
        return [experts, rows, columns]


def gate_up_halves(target: str, inter: int) -> list[tuple[str, Any, Any]]:
    """(parameter, shard id, view) of the gate and up halves of a fused gate_up expert stack
    of `inter` rows each, loading into `target` as the separate stacks do (shard (ALL, part))."""
    return [
        (target, (ALL, part), lambda source, part=part: StackRows(source, part * inter, inter))
        for part in (0, 1)
    ]


class BiasColumns:
    """Columns [column0, column0 + columns) of an expert stack's bias [experts, rows] (a GGUF
    loader's TensorSource), read like a bias of its own: `get_shape()`, `source[...]`."""

    def __init__(self, source: Any, column0: int, columns: int):
        experts, width = (int(d) for d in source.get_shape())
        if column0 < 0 or columns < 1 or column0 + columns > width:
            raise ValueError(f"bias columns {column0}..{column0 + columns} of {width}")
        self.source, self.experts = source, experts
        self.columns = slice(column0, column0 + columns)
        self.dtype = source.dtype

    def get_shape(self) -> list[int]:
        return [self.experts, self.columns.stop - self.columns.start]

    def __getitem__(self, key: Any) -> Any:
        return self.source[:, self.columns][key]


def gate_up_bias_halves(target: str, inter: int) -> list[tuple[str, Any, Any]]:
    """(parameter, shard id, view) of the gate and up halves of a fused gate_up stack's bias
    [E, 2 inter], loading into `target` (the experts' gate_up_proj_bias) as the separate
    biases do (shard (ALL, part))."""
    return [
        (target, (ALL, part), lambda source, part=part: BiasColumns(source, part * inter, inter))
        for part in (0, 1)
    ]
