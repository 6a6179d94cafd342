"""cpud.native: CPU kernels in C (cffi) with runtime ISA dispatch.

    from cpud import native
    if native.available():
        k = native.kernels()            # default tier: native.isa()
        k.rms_norm(x, w, 1e-6)
        k16 = native.Kernels("avx2")    # an explicit tier (tests, comparisons)

Tiers, lowest first: scalar, avx2, avx512, avx512bf16, amx (avx512bf16 with GEMMs of 4+ rows
on AMX-BF16 tiles, where the kernel grants tile data).  ``isa()`` is the
highest one the CPU runs, lowered by ``CPUD_ISA``; a tier the CPU cannot run is
never executed.  Without the compiled module (no compiler at install time)
this package still imports and ``available()`` is False.  Importing the package loads
nothing: each name is imported from its submodule on first use.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .kernels import Kernels

# Public name -> the submodule that defines it, imported on first use: importing cpud.native
# loads neither torch nor the compiled library, so the control processes (the supervisor sets up
# the shared-memory segment at tp > 1) never map libtorch.
_LAZY = {
    **dict.fromkeys(
        ["ISAS", "available", "default_isa", "detected_isa", "load_error", "supported_isas"],
        "_loader",
    ),
    **dict.fromkeys(
        [
            "Kernels",
            "PackedWeight",
            "empty_packed",
            "max_threads",
            "pack_rows",
            "pack_weight",
            "packed_shape",
            "packed_with_bias",
            "pin_threads",
            "thread_cpus",
        ],
        "kernels",
    ),
    **dict.fromkeys(["QuantWeight", "pack_quantized", "quant_gemm", "quant_kernel"], "quant"),
    **dict.fromkeys(
        [
            "CollectiveError",
            "CollectiveMismatch",
            "CollectiveTimeout",
            "GroupAborted",
            "PeerDied",
            "ShmGroup",
        ],
        "shm_allreduce",
    ),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


__all__ = [
    "ISAS",
    "CollectiveError",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "GroupAborted",
    "PeerDied",
    "QuantWeight",
    "ShmGroup",
    "Kernels",
    "PackedWeight",
    "available",
    "detected_isa",
    "empty_packed",
    "info",
    "isa",
    "kernels",
    "load_error",
    "max_threads",
    "pack_rows",
    "pack_weight",
    "packed_shape",
    "pack_quantized",
    "packed_with_bias",
    "pin_threads",
    "quant_gemm",
    "quant_kernel",
    "supported_isas",
    "thread_cpus",
]


def isa() -> str:
    """Tier the default kernels use ("none" when the library is not available)."""
    from ._loader import default_isa

    return default_isa()


@functools.cache
def _kernels() -> Kernels:
    """The process-wide Kernels at the default tier (raises RuntimeError if unavailable)."""
    from .kernels import Kernels

    return Kernels()


class _Package(types.ModuleType):
    """``cpud.native.kernels`` is the function above, also once the submodule of that name is
    imported (the import system binds a package's submodules as its attributes)."""

    @property
    def kernels(self) -> Callable[[], Kernels]:
        return _kernels

    @kernels.setter
    def kernels(self, submodule: types.ModuleType) -> None:
        pass


sys.modules[__name__].__class__ = _Package


def info() -> dict[str, Any]:
    """What is active, for `cpud doctor --json`."""
    from ._loader import available, detected_isa, load_error, supported_isas
    from .kernels import max_threads

    return {
        "available": available(),
        "isa": isa(),
        "detected_isa": detected_isa(),
        "supported_isas": supported_isas(),
        "openmp_threads": max_threads() if available() else None,
        "error": load_error(),
    }
