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
this package still imports and ``available()`` is False.
"""

from __future__ import annotations

import functools
from typing import Any

from ._loader import ISAS, available, default_isa, detected_isa, load_error, supported_isas
from .kernels import (
    Kernels,
    PackedWeight,
    empty_packed,
    max_threads,
    pack_rows,
    pack_weight,
    packed_shape,
    packed_with_bias,
    pin_threads,
    thread_cpus,
)
from .quant import QuantWeight, pack_quantized, quant_gemm, quant_kernel
from .shm_allreduce import (
    CollectiveError,
    CollectiveMismatch,
    CollectiveTimeout,
    GroupAborted,
    PeerDied,
    ShmGroup,
)

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
    return default_isa()


@functools.cache
def kernels() -> Kernels:
    """The process-wide Kernels at the default tier (raises RuntimeError if unavailable)."""
    return Kernels()


def info() -> dict[str, Any]:
    """What is active, for `cpud doctor --json`."""
    return {
        "available": available(),
        "isa": isa(),
        "detected_isa": detected_isa(),
        "supported_isas": supported_isas(),
        "openmp_threads": max_threads() if available() else None,
        "error": load_error(),
    }
