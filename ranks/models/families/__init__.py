"""The families cpud ships, one module each, found by name: a module here declares FAMILY
(ranks/models/registry.py). A new family is such a module and its tests (README: Adding a
model family)."""

from __future__ import annotations

import importlib
import pkgutil

from cpud.ranks.models.family import Family


def _discover() -> tuple[Family, ...]:
    modules = sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name)
    return tuple(importlib.import_module(f"{__name__}.{m.name}").FAMILY for m in modules)


FAMILIES: tuple[Family, ...] = _discover()
