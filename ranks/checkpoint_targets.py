"""Where a checkpoint tensor lands in the model, and whether every parameter was loaded."""

from __future__ import annotations

from torch import nn

from cpud.errors import ConfigError


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
