"""A GGUF file's model: cpud's decoder config from the file's metadata, and the checks
(architecture, tensor names, shapes and types, the split for --tp) that make a bad file a
ConfigError before any rank starts. Reads metadata and tensor headers only."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gguf import GGUFReader
from gguf.gguf_reader import ReaderTensor

from cpud.model.gguf_file import field_value, open_gguf
from cpud.model.gguf_header import shown
from cpud.model.gguf_meta import ROPE_FREQS, GGUFMeta, TensorInfo, short
from cpud.model.gguf_names import COLUMNS, expected_tensors, with_fused_gate_up
from cpud.model.model_config import ModelConfig
from cpud.model.pooling_config import gguf_pooling
from cpud.model.recipe import check_recipe
from cpud.native.quant_formats import SUPPORTED_TYPES
from cpud.ranks.models import registry
from cpud.settings.errors import ConfigError


@dataclass(frozen=True)
class GGUFModel:
    path: Path
    architecture: str  # the file's general.architecture
    config: ModelConfig
    tensors: dict[str, TensorInfo]
    # The tensors' data, memory mapped, in file order, until mapped_tensors hands it to a
    # loader; the reader's parsed metadata (tens of MB for a large vocabulary) is not kept.
    data: dict[str, ReaderTensor] = field(default_factory=dict, repr=False, compare=False)
    # The tokenizer.* keys (and general.architecture) as values, read in the same parse so
    # that cpud.text.gguf_tokenizer does not parse the file again; empty when built from facts.
    tokenizer_keys: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def bytes_by_type(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for info in self.tensors.values():
            totals[info.type] = totals.get(info.type, 0) + info.n_bytes
        return totals


def _tensor_infos(reader: GGUFReader) -> dict[str, TensorInfo]:
    return {
        t.name: TensorInfo(
            t.name,
            t.tensor_type.name,
            tuple(int(d) for d in reversed(t.shape.tolist())),
            int(t.n_bytes),
        )
        for t in reader.tensors
    }


def _check_tensors(model: GGUFModel) -> None:
    source = model.path
    for info in model.tensors.values():
        if info.type not in SUPPORTED_TYPES:
            raise ConfigError(
                f"{source}: tensor {shown(info.name)} is {info.type}, a type cpud does not load "
                f"(supported: {', '.join(SUPPORTED_TYPES)}); use a file quantized to one of those"
            )
    expected = with_fused_gate_up(expected_tensors(model.config), model.tensors)
    for name, info in model.tensors.items():
        if name == ROPE_FREQS:
            continue
        spec = expected.get(name)
        if spec is None:
            raise ConfigError(
                f"{source} holds tensor {shown(name)}, which cpud's {model.architecture} decoder "
                f"does not have: the file's metadata does not match its tensors (convert it again)"
            )
        if spec.shape != info.shape:
            raise ConfigError(
                f"{source}: tensor {name} has shape {info.shape}, but the file's metadata "
                f"implies {spec.shape} (convert the model again)"
            )
    missing = [name for name in expected if name not in model.tensors]
    if missing:
        raise ConfigError(
            f"{source} lacks tensor {missing[0]} and {len(missing) - 1} more: the file is "
            f"incomplete (convert the model again)"
        )


def _identity(path: Path) -> tuple[str, int, int]:
    try:
        st = path.stat()
    except OSError as exc:
        raise ConfigError(f"{path} cannot be read: {exc.strerror or exc}") from None
    return str(path.resolve()), st.st_size, st.st_mtime_ns


_CACHE: dict[tuple[str, int, int], GGUFModel] = {}
_CACHE_SIZE = 4


def _read(identity: tuple[str, int, int]) -> GGUFModel:
    path = Path(identity[0])
    reader = open_gguf(path)
    arch = field_value(reader, "general.architecture", None)
    family = registry.for_gguf(arch) if isinstance(arch, str) else None
    if family is None or family.gguf_config is None:
        raise ConfigError(
            f"{path}: GGUF architecture {short(arch)} is not supported "
            f"(supported: {', '.join(registry.supported_gguf())})"
        )
    splits = field_value(reader, "split.count", 1)
    if splits != 1:
        raise ConfigError(
            f"{path} is one part of a {short(splits)}-file split GGUF: merge the parts into one "
            f"file (llama-gguf-split --merge) and pass that"
        )
    tensors = _tensor_infos(reader)
    config = family.gguf_config(GGUFMeta(reader, arch, str(path), tensors))
    key = f"{arch}.pooling_type"
    pooling = gguf_pooling(field_value(reader, key, None), str(path), key)
    if pooling:
        config = replace(config, **pooling)
    if config.recipe is not None:
        check_recipe(config.recipe, config.head_dim, str(path))
    keys = [k for k in reader.fields if k.startswith("tokenizer.") or k == "general.architecture"]
    data = {t.name: t for t in reader.tensors}
    model = GGUFModel(
        path, arch, config, tensors, data, {key: field_value(reader, key) for key in keys}
    )
    _check_tensors(model)
    return model


def read_gguf_model(path: str | os.PathLike) -> GGUFModel:
    """The file's architecture, config and tensor list, checked; cached per file version."""
    identity = _identity(Path(path))
    model = _CACHE.get(identity)
    if model is None:
        model = _read(identity)
        while len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[identity] = model
    return model


def cached_gguf_model(path: str | os.PathLike) -> GGUFModel | None:
    """The file's model if this process has read this version of it already (no parse)."""
    try:
        return _CACHE.get(_identity(Path(path)))
    except ConfigError:
        return None


def remember_gguf_model(model: GGUFModel, size: int, mtime_ns: int) -> bool:
    """Files `model`, built from what a checked read of the file found (in another process),
    as this process's read of it; False (nothing filed) when the file is no longer of that
    size and mtime."""
    identity = _identity(model.path)
    if identity[1:] != (size, mtime_ns):
        return False
    while len(_CACHE) >= _CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[identity] = model
    return True


def mapped_tensors(path: str | os.PathLike) -> dict[str, ReaderTensor]:
    """The file's tensors, memory mapped, in file order; the cache keeps no reference to them,
    so the mapping goes when the caller (a loader) drops them. The first call after the config
    was read takes its reader's tensors; later ones open the file again."""
    model = read_gguf_model(path)
    data = model.data or {t.name: t for t in open_gguf(model.path).tensors}
    _CACHE[_identity(model.path)] = replace(model, data={})
    return data


def gguf_model_config(path: str | os.PathLike) -> ModelConfig:
    return read_gguf_model(path).config


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, min(n, 64) + 1) if n % d == 0)


def _first(model: GGUFModel, *stems: str) -> str:
    """The name of layer 0's first tensor among `stems` the file has (for messages)."""
    names = (f"blk.0.{stem}.weight" for stem in stems)
    return next((n for n in names if n in model.tensors), f"blk.0.{stems[0]}.weight")


def check_gguf_split(model: GGUFModel, tp: int) -> None:
    """ConfigError naming the first tensor that cannot be split for --tp: heads and the MLP width
    must divide, and each rank's range of a row-parallel matrix must be whole blocks."""
    cfg = model.config
    if tp == 1:
        return
    if cfg.num_heads % tp:
        raise ConfigError(
            f"{model.path}: {_first(model, 'attn_q', 'attn_qkv')} holds {cfg.num_heads} heads, "
            f"which do not split "
            f"across --tp {tp}: use a --tp among {_divisors(cfg.num_heads)}"
        )
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        raise ConfigError(
            f"{model.path}: {_first(model, 'attn_k', 'attn_qkv')} holds {cfg.num_kv_heads} KV "
            f"heads, which neither "
            f"split across nor replicate evenly over --tp {tp}"
        )
    if cfg.is_moe and cfg.moe_intermediate_size % tp:
        raise ConfigError(
            f"{model.path}: the experts' {cfg.moe_intermediate_size} rows do not split across "
            f"--tp {tp}: use a --tp among {_divisors(cfg.moe_intermediate_size)}"
        )
    if cfg.intermediate_size % tp and len(cfg.dense_layers) + (not cfg.is_moe):
        raise ConfigError(
            f"{model.path}: blk.0.ffn_up.weight has {cfg.intermediate_size} rows, which do not "
            f"split across --tp {tp}: use a --tp among {_divisors(cfg.intermediate_size)}"
        )
    for name, spec in with_fused_gate_up(expected_tensors(cfg), model.tensors).items():
        info = model.tensors[name]
        if spec.split != COLUMNS:
            continue
        columns = info.shape[-1]
        if (columns // tp) % info.block_size:
            blocks = columns // info.block_size
            raise ConfigError(
                f"{model.path}: tensor {name} ({info.type}, blocks of {info.block_size} values) "
                f"has {columns} columns, which do not split into whole blocks across --tp {tp}: "
                f"use a --tp among {_divisors(blocks)}"
            )
