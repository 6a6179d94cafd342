"""The model families cpud runs. Each family module (ranks/models/families/) declares one
`Family` (ranks/models/family.py): the Hugging Face and GGUF architecture names it answers to,
how its config and tensor names map onto cpud's decoder, and the decoder recipe its config
implies. Nothing
outside a family's module and this registry names a family. Torch-free: the supervisor and
the frontend read configs through it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from cpud.ranks.models.families import FAMILIES
from cpud.ranks.models.family import Family
from cpud.settings.errors import ConfigError

__all__ = ["Family", "by_name", "families", "for_gguf", "for_hf", "hf_match", "registered"]


_ADDED: list[Family] = []  # families registered by `registered` (plug-ins, tests)


def families() -> tuple[Family, ...]:
    return (*FAMILIES, *_ADDED)


def by_name(name: str) -> Family:
    for family in families():
        if family.name == name:
            return family
    raise ConfigError(f"model family {name!r} is not registered")


def hf_match(architectures: list[Any]) -> tuple[Family, str] | None:
    """(family, architecture) of the first architecture in config.json's list that a family
    answers to."""
    for arch in architectures:
        for family in families():
            if arch in family.hf_architectures:
                return family, arch
    return None


def for_hf(architectures: list[Any]) -> Family | None:
    match = hf_match(architectures)
    return None if match is None else match[0]


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
