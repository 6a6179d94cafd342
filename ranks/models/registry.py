"""The model families cpud runs. Each family module (ranks/models/families/) declares one
`Family`: the Hugging Face and GGUF architecture names it answers to, how its config and
tensor names map onto cpud's decoder, and the decoder recipe its config implies. Nothing
outside a family's module and this registry names a family. Torch-free: the supervisor and
the frontend read configs through it."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cpud.errors import ConfigError

if TYPE_CHECKING:
    from cpud.model.gguf_meta import GGUFMeta
    from cpud.model.model_config import ConfigFields, ModelConfig

# The torch modules that build a family's model (ranks/models/build.py)
MODEL_KINDS = ("decoder", "moe", "opt")


@dataclass(frozen=True)
class Family:
    name: str
    hf_architectures: tuple[str, ...]
    # config.json (read through ConfigFields) -> ModelConfig with its recipe
    hf_config: Callable[[ConfigFields, str], ModelConfig]
    gguf_architectures: tuple[str, ...] = ()
    # GGUF metadata and tensor table -> ModelConfig with its recipe
    gguf_config: Callable[[GGUFMeta], ModelConfig] | None = None
    model: str = "decoder"
    # (checkpoint name fragment, cpud module name fragment); the first that matches applies
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    # A checkpoint tensor holding several of cpud's parts stacked by rows: (checkpoint
    # fragment, cpud fragment, part ids in row order); sizes come from the model.
    fused_checkpoint: tuple[tuple[str, str, tuple[Any, ...]], ...] = ()
    # GGUF layer tensor stems -> cpud module names, over the common table (model/gguf_names.py)
    gguf_layer_names: Mapping[str, str] = field(default_factory=dict)
    # llama.cpp's converter interleaves Q/K rows of these GGUF architectures for its RoPE
    gguf_permuted_qk: tuple[str, ...] = ()
    # GGUF tensors of a config (name -> Expected) when they differ from the common table
    gguf_tensors: Callable[[ModelConfig], dict[str, Any]] | None = None
    # Chat template for files that carry none
    chat_template: str | None = None
    # (checkpoint tensor, K per rank) of each kind of linear when not the Llama names
    linear_ks: Callable[[ModelConfig, int], list[tuple[str, int]]] | None = None
    linears_per_layer: int = 7  # q, k, v, o, gate, up, down

    def __post_init__(self) -> None:
        if self.model not in MODEL_KINDS:
            raise ValueError(f"family {self.name}: model {self.model!r} not in {MODEL_KINDS}")


def _builtin() -> tuple[Family, ...]:
    from cpud.ranks.models.families import FAMILIES

    return FAMILIES


_ADDED: list[Family] = []  # families registered by `registered` (plug-ins, tests)


def families() -> tuple[Family, ...]:
    return (*_builtin(), *_ADDED)


def by_name(name: str) -> Family:
    for family in families():
        if family.name == name:
            return family
    raise ConfigError(f"model family {name!r} is not registered")


def for_hf(architectures: list[Any]) -> Family | None:
    """The family of the first architecture in config.json's list that one answers to."""
    for arch in architectures:
        for family in families():
            if arch in family.hf_architectures:
                return family
    return None


def hf_architecture(architectures: list[Any]) -> str | None:
    family = for_hf(architectures)
    if family is None:
        return None
    return next(a for a in architectures if a in family.hf_architectures)


def for_gguf(architecture: str) -> Family | None:
    for family in families():
        if architecture in family.gguf_architectures:
            return family
    return None


def supported_hf() -> list[str]:
    return sorted(a for f in families() for a in f.hf_architectures)


def supported_gguf() -> list[str]:
    return sorted(a for f in families() for a in f.gguf_architectures)


@contextmanager
def registered(family: Family) -> Iterator[Family]:
    """`family` is registered inside the block (in this process)."""
    if any(f.name == family.name for f in families()):
        raise ValueError(f"a family named {family.name!r} is registered already")
    _ADDED.append(family)
    try:
        yield family
    finally:
        _ADDED.remove(family)
