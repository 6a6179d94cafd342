"""Read this rank's slices of the weights from safetensors files (single or sharded) or a GGUF
file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from safetensors import SafetensorError, safe_open
from torch import nn

from cpud.errors import ConfigError
from cpud.ranks.safetensors_check import weight_files


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


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as exc:
        raise ConfigError(f"{path} is not a readable safetensors file: {exc}") from None


def load_weights(
    model: nn.Module,
    model_dir: str | Path,
    progress: Callable[[int, int], None] | None = None,
    skip: frozenset[str] = frozenset(),
) -> None:
    """Fill every parameter of `model` from the checkpoint, reading only this rank's slices;
    `progress(done, total)` hears after each tensor. Parameters named in `skip` are filled
    already (packed weights from the weight cache): their tensors are not read."""
    if Path(model_dir).is_file():
        from cpud.ranks.gguf_loader import load_gguf_weights

        return load_gguf_weights(model, model_dir, progress, skip)
    params = dict(model.named_parameters())
    tied = model.cfg.tie_word_embeddings
    loaded: set[tuple[str, object]] = set()
    files = weight_files(model_dir)
    total = 0
    for path in files:
        with _open(path) as f:
            total += len(f.keys())
    done = 0
    for path in files:
        with _open(path) as f:
            for name in f.keys():
                done += 1
                if progress is not None:
                    progress(done, total)
                ckpt_name = model.checkpoint_name(name)
                if ckpt_name.endswith(model.ignored_suffixes):
                    continue
                if tied and ckpt_name == "lm_head.weight":
                    continue
                target, shard_id = stacked_target(model, ckpt_name)
                param = params.get(target)
                if param is None:
                    raise ConfigError(
                        f"{path.name} holds tensor {name!r}, which {model.cfg.architecture} "
                        f"does not have: config.json does not match the weights"
                    )
                if target not in skip:
                    param.weight_loader(param, f.get_slice(name), shard_id)
                loaded.add((target, shard_id))
    check_complete(model, params, loaded, str(model_dir))
