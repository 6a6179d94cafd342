"""Fill a model's parameters from a GGUF file: each rank reads only its own slices of the
memory-mapped tensors and dequantizes them into the model's dtype, one tensor at a time."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.gguf_reader import ReaderTensor
from torch import nn

from cpud.model.gguf_model import mapped_tensors, read_gguf_model
from cpud.model.gguf_names import hf_name
from cpud.ranks.checkpoint_targets import check_complete, load_tensor
from cpud.ranks.gguf_blocks import Blocks, slice_blocks, tensor_shape, to_dense
from cpud.ranks.models import registry
from cpud.settings.errors import ConfigError

RowOrder = Callable[[np.ndarray], np.ndarray]


def unpermute_rows(head_dim: int) -> RowOrder:
    """Hugging Face row numbers -> the file's rows of a `llama` Q or K projection. llama.cpp's
    converter interleaves each head's rotate-half pairs (rows i and i + d/2 become 2i and
    2i + 1) for its RoPE kernel; transformers' GGUF loader undoes it the same way."""
    half = head_dim // 2

    def order(rows: np.ndarray) -> np.ndarray:
        head, j = np.divmod(rows, head_dim)
        upper, i = np.divmod(j, half)
        return head * head_dim + 2 * i + upper

    return order


def _key(key: Any) -> tuple[slice, slice]:
    if isinstance(key, tuple) and len(key) == 2 and all(isinstance(k, slice) for k in key):
        return key
    if isinstance(key, slice):
        return key, slice(None)
    raise TypeError(f"GGUF tensors are read by row and column ranges, not {key!r}")


class TensorSource:
    """One GGUF tensor as the layers' weight loaders read a checkpoint tensor (`get_shape()`,
    `source[rows]`, `source[:, columns]`): a read takes only the blocks it needs from the file
    and returns them dense in `dtype`; `row_order` maps Hugging Face rows to the file's."""

    def __init__(self, tensor: ReaderTensor, dtype: torch.dtype, row_order: RowOrder | None = None):
        self.tensor = tensor
        self.dtype = dtype
        self.row_order = row_order
        self.shape = tensor_shape(tensor)

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def blocks(self, rows: slice, columns: slice = slice(None)) -> Blocks:
        """The rows (Hugging Face numbering) and whole-block columns, in the stored format."""
        picked: slice | np.ndarray = rows
        if self.row_order is not None:
            picked = self.row_order(np.arange(*rows.indices(self.shape[0])))
        return slice_blocks(self.tensor, picked, columns)

    def __getitem__(self, key: Any) -> torch.Tensor:
        rows, columns = _key(key)
        if len(self.shape) == 1:
            whole = to_dense(slice_blocks(self.tensor, slice(None)), self.dtype).reshape(-1)
            if self.row_order is None:
                return whole[rows]
            return whole[torch.from_numpy(self.row_order(np.arange(*rows.indices(len(whole)))))]
        return to_dense(self.blocks(rows, columns), self.dtype)


def load_gguf_weights(
    model: nn.Module,
    path: str | Path,
    progress: Callable[[int, int], None] | None = None,
    skip: frozenset[str] = frozenset(),
) -> None:
    """Fill every parameter of `model` from the GGUF file at `path` (see loader.load_weights)."""
    checked = read_gguf_model(path)
    params = dict(model.named_parameters())
    family = registry.by_name(model.cfg.family)
    permuted = checked.architecture in family.gguf_permuted_qk
    order = unpermute_rows(model.cfg.head_dim) if permuted else None
    tensors = [(t, hf_name(t.name, family.name)) for t in mapped_tensors(path).values()]
    tensors = [(t, name) for t, name in tensors if name is not None]
    loaded: set[tuple[str, object]] = set()
    for done, (tensor, name) in enumerate(tensors, 1):
        if progress is not None:
            progress(done, len(tensors))
        load_tensor(
            model,
            params,
            name,
            tensor,
            skip,
            loaded,
            lambda tensor=tensor: ConfigError(
                f"{path} holds tensor {tensor.name}, which {model.cfg.architecture} does not have"
            ),
            lambda t, param, shard_id: TensorSource(
                t, param.dtype, order if shard_id in ("q", "k") else None
            ),
        )
    check_complete(model, params, loaded, str(path))
