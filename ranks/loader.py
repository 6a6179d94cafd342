"""Read this rank's slices of the weights from safetensors files (single or sharded) or a GGUF
file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torch import nn

from cpud.ranks.checkpoint_targets import check_complete, load_tensor
from cpud.ranks.hf_mxfp4 import Mxfp4Source, pair_names
from cpud.settings.errors import ConfigError


def _open(path: Path):
    from safetensors import SafetensorError, safe_open  # not for GGUF files

    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as exc:
        raise ConfigError(f"{path} is not a readable safetensors file: {exc}") from None


def _mxfp4_source(f, path: Path, owner: dict[str, Path], name: str, scales: str, blocks):
    """The Mxfp4Source of a `_blocks` tensor and its `_scales` (read whole: [..., G] bytes, a
    32nd of the values' count), which may lie in another file."""
    if owner[scales] == path:
        return Mxfp4Source(name, blocks, f.get_slice(scales)[:])
    with _open(owner[scales]) as other:
        return Mxfp4Source(name, blocks, other.get_slice(scales)[:])


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
    from cpud.model.safetensors_check import weight_files

    params = dict(model.named_parameters())
    tied = model.cfg.tie_word_embeddings
    loaded: set[tuple[str, object]] = set()
    files = weight_files(model_dir)
    owner: dict[str, Path] = {}
    for path in files:
        with _open(path) as f:
            owner.update((name, path) for name in f.keys())
    total = len(owner)
    # MXFP4 tensors (transformers' mxfp4 quantization): X_blocks read with X_scales as one
    pairs = pair_names(set(owner))
    partners = set(pairs.values())
    done = 0
    for path in files:
        with _open(path) as f:
            for name in f.keys():
                done += 1
                if progress is not None:
                    progress(done, total)
                if name in partners:
                    continue
                ckpt_name = model.checkpoint_name(name)
                if ckpt_name.endswith(model.ignored_suffixes):
                    continue
                if tied and ckpt_name == "lm_head.weight":
                    continue
                source = f.get_slice(name)
                if name in pairs:
                    source = _mxfp4_source(f, path, owner, name, pairs[name], source)
                load_tensor(
                    model,
                    params,
                    ckpt_name,
                    source,
                    skip,
                    loaded,
                    lambda path=path, name=name: ConfigError(
                        f"{path.name} holds tensor {name!r}, which {model.cfg.architecture} "
                        f"does not have: config.json does not match the weights"
                    ),
                )
    check_complete(model, params, loaded, str(model_dir))
