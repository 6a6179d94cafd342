"""Loads the compiled kernel module and decides the default ISA tier.

torch is not imported here.  The module binds to the OpenMP runtime already in the process:
the modules that take tensors (kernels.py, quant.py) import torch before this one, so in the
ranks that is torch's bundled libgomp (one runtime per process); the supervisor loads the module
without torch, for the shared-memory segment's setup.  A missing or broken module is not an
error here: ``available()`` is False and callers keep their torch path.  ``CPUD_ISA`` is read
once, here.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
from typing import Any

log = logging.getLogger("cpud.native")

# Index == the C enum cpud_isa; lowest tier first.
ISAS: tuple[str, ...] = ("scalar", "avx2", "avx512", "avx512bf16", "amx")
ISA_ENV = "CPUD_ISA"

ffi: Any = None
lib: Any = None
_load_error: str | None = None
_MODULE = f"{__package__}._cpud_native"
try:
    if importlib.util.find_spec(_MODULE) is None:
        _load_error = f"{_MODULE} is not built (it is compiled at install time; no C compiler?)"
    else:
        _mod = importlib.import_module(_MODULE)
        ffi, lib = _mod.ffi, _mod.lib
except ImportError as exc:  # a module that fails to load
    _load_error = f"{type(exc).__name__}: {exc}"


def available() -> bool:
    """True when the compiled kernel library is loaded."""
    return lib is not None


def load_error() -> str | None:
    """Why the library is not available, or None."""
    return _load_error


@functools.cache
def detected_isa() -> str:
    """Highest tier this CPU/OS can run (cpuid + XGETBV); "none" without the library."""
    return ISAS[lib.cpud_detect_isa()] if lib is not None else "none"


def supported_isas() -> list[str]:
    """Tiers this machine can run, lowest first; [] without the library."""
    if lib is None:
        return []
    return list(ISAS[: ISAS.index(detected_isa()) + 1])


def resolve_isa(requested: str | None, detected: str) -> tuple[str, str | None]:
    """Tier to use given a CPUD_ISA value: (tier, warning or None). Never raises."""
    if not requested:
        return detected, None
    req = requested.strip().lower()
    if req not in ISAS:
        return (
            detected,
            f"{ISA_ENV}={requested!r} is not one of {', '.join(ISAS)}; using {detected}",
        )
    if ISAS.index(req) > ISAS.index(detected):
        return detected, f"{ISA_ENV}={req} is not supported by this CPU; using {detected}"
    return req, None


@functools.cache
def default_isa() -> str:
    """The tier kernels use unless told otherwise: detected, lowered by CPUD_ISA."""
    if lib is None:
        return "none"
    tier, warning = resolve_isa(os.environ.get(ISA_ENV), detected_isa())
    if warning:
        log.warning("%s", warning)
    return tier
