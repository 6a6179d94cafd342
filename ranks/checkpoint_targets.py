"""Where a checkpoint tensor lands in the model, and whether every parameter was loaded."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from cpud.ranks.models.expert_views import Mxfp4Rows
from cpud.settings.errors import ConfigError


class RowWindow:
    """Rows [row0, row0 + rows) of a checkpoint tensor, read like a tensor of its own (one
    part of a tensor that stacks several, such as Phi-3's qkv_proj)."""

    def __init__(self, source: Any, row0: int, rows: int):
        self.source, self.row0, self.rows = source, row0, rows

    def get_shape(self) -> list[int]:
        shape = self.source.get_shape()
        return [self.rows, *list(shape)[1:]]

    def _rows(self, key: slice) -> slice:
        start, stop, step = key.indices(self.rows)
        if step != 1:
            raise TypeError("a window of a checkpoint tensor is read by contiguous rows")
        return slice(self.row0 + start, self.row0 + stop)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, tuple):
            return self.source[(self._rows(key[0]), *key[1:])]
        return self.source[self._rows(key)]

    def blocks(self, rows: slice, columns: slice = slice(None)) -> Any:
        return self.source.blocks(self._rows(rows), columns)


Window = tuple[int, int] | Mxfp4Rows | Callable[[Any], Any] | None


def targets(model: nn.Module, name: str) -> list[tuple[str, object, Window]]:
    """(parameter, shard id, (first row, rows), a view of the source, or None) of each piece a
    checkpoint tensor loads into: one, or one per part of a tensor the family stacks
    (Model.fused_parts: (target, shard, row0, rows) or (target, shard, view))."""
    fused = getattr(model, "fused_parts", None)
    parts = fused(name) if fused is not None else None
    if parts:
        return [(p[0], p[1], p[2] if len(p) == 3 else (p[2], p[3])) for p in parts]
    target, shard_id = stacked_target(model, name)
    return [(target, shard_id, None)]


def load_tensor(
    model: nn.Module,
    params: dict[str, nn.Parameter],
    name: str,
    source: Any,
    skip: frozenset[str],
    loaded: set[tuple[str, object]],
    missing: Callable[[], ConfigError],
    wrap: Callable[[Any, nn.Parameter, object], Any] = lambda source, param, shard_id: source,
) -> None:
    """Loads checkpoint tensor `name` (cpud's name) from `source` into its parameter(s), each
    reading `wrap(source, param, shard_id)`; `missing()` is raised when the model has no such
    parameter."""
    for target, shard_id, window in targets(model, name):
        param = params.get(target)
        if param is None:
            raise missing()
        if target not in skip:
            piece = wrap(source, param, shard_id)
            if isinstance(window, Mxfp4Rows):
                from cpud.ranks.hf_mxfp4 import Mxfp4Stack

                piece = Mxfp4Stack(piece, window.rows)
            elif callable(window):
                piece = window(piece)
            elif window is not None:
                piece = RowWindow(piece, *window)
            param.weight_loader(param, piece, shard_id)
        loaded.add((target, shard_id))


def stacked_target(model: nn.Module, name: str) -> tuple[str, object]:
    custom = getattr(model, "checkpoint_target", None)  # e.g. one expert's slice of a stack
    found = custom(name) if custom is not None else None
    if found is not None:
        return found
    for param_part, ckpt_part, shard_id in model.stacked_params:
        if f".{ckpt_part}." in name:
            return name.replace(f".{ckpt_part}.", f".{param_part}."), shard_id
    return name, None


def check_complete(
    model: nn.Module,
    params: dict[str, nn.Parameter],
    loaded: set[tuple[str, object]],
    source: str,
) -> None:
    """ConfigError when a parameter (or a part of a fused one) was not in the checkpoint."""
    expected = set()
    for name in params:
        custom = getattr(model, "param_shards", None)
        shards = custom(name) if custom is not None else None
        shards = shards or [s for p, _, s in model.stacked_params if f".{p}." in name]
        expected.update((name, s) for s in shards or [None])
    expand = getattr(model, "loaded_shards", None)  # e.g. a stack of every expert at once
    loaded = expand(loaded) if expand is not None else loaded
    missing = sorted(expected - loaded, key=str)
    if missing:
        name, shard = missing[0]
        what = name if shard is None else f"{name} (part {shard})"
        raise ConfigError(
            f"checkpoint in {source} lacks {what} and {len(missing) - 1} more tensor(s)"
        )
