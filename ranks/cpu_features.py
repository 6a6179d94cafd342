"""What the CPU can compute natively, read from /proc/cpuinfo (path is a parameter for tests)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from cpud.errors import ConfigError

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

# A dtype is usable when the CPU has native arithmetic for it or AVX-512 to emulate it at speed.
_DTYPE_NEEDS = {
    torch.bfloat16: ({"avx512_bf16", "amx_bf16", "avx512f"}, "AVX512-BF16, AMX-BF16 or AVX-512"),
    torch.float16: ({"avx512_fp16", "amx_fp16", "avx512f"}, "AVX512-FP16, AMX-FP16 or AVX-512"),
    torch.float32: (set(), ""),
}


@lru_cache(maxsize=4)
def cpu_flags(cpuinfo_path: str = "/proc/cpuinfo") -> frozenset[str]:
    try:
        text = Path(cpuinfo_path).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def parse_dtype(name: str) -> torch.dtype:
    key = str(name).lower().removeprefix("torch.")
    if key not in DTYPES:
        raise ConfigError(
            f"unsupported dtype {name!r}: use one of bfloat16, float16, float32, auto"
        )
    return DTYPES[key]


def resolve_dtype(requested: str, flags: frozenset[str] | None = None) -> torch.dtype:
    """'auto' picks bf16 where the CPU computes it natively, else fp32."""
    flags = cpu_flags() if flags is None else flags
    if str(requested).lower() == "auto":
        return torch.bfloat16 if {"avx512_bf16", "amx_bf16"} & flags else torch.float32
    dtype = parse_dtype(requested)
    check_dtype_supported(dtype, flags)
    return dtype


def check_dtype_supported(dtype: torch.dtype, flags: frozenset[str]) -> None:
    needs, names = _DTYPE_NEEDS[dtype]
    if needs and not needs & flags:
        short = str(dtype).removeprefix("torch.")
        raise ConfigError(f"dtype {short} needs {names}, which this CPU lacks: use --dtype float32")
