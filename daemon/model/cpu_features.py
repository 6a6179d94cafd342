"""What the CPU can compute natively, read from /proc/cpuinfo (path is a parameter for tests)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from cpud.settings.errors import ConfigError

# Accepted spellings -> the dtype's name (torch's attribute name).
DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}

# A dtype is usable when the CPU has native arithmetic for it or vector units to emulate it at
# speed: cpud's kernels widen bf16 weights to fp32 in registers on AVX-512 and AVX2 (with FMA).
_DTYPE_NEEDS = {
    "bfloat16": (
        {"avx512_bf16", "amx_bf16", "avx512f", "avx2"},
        "AVX512-BF16, AMX-BF16, AVX-512 or AVX2",
    ),
    "float16": ({"avx512_fp16", "amx_fp16", "avx512f"}, "AVX512-FP16, AMX-FP16 or AVX-512"),
    "float32": (set(), ""),
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


def parse_dtype(name: str) -> str:
    key = str(name).lower().removeprefix("torch.")
    if key not in DTYPES:
        raise ConfigError(
            f"unsupported dtype {name!r}: use one of bfloat16, float16, float32, auto"
        )
    return DTYPES[key]


def resolve_dtype(
    requested: str,
    flags: frozenset[str] | None = None,
    checkpoint_dtype: str | None = None,
    kernels: str = "auto",
) -> str:
    """'auto' keeps the checkpoint's own dtype: fp32 stays fp32; bf16, fp16 and quantized or
    unlabelled weights run in bf16 wherever cpud computes it (natively, or emulated by the
    native kernels on AVX-512 and AVX2), else in fp32."""
    flags = cpu_flags() if flags is None else flags
    if str(requested).lower() == "auto":
        if checkpoint_dtype is not None and DTYPES.get(checkpoint_dtype.lower()) == "float32":
            return "float32"
        native = {"avx512_bf16", "amx_bf16"} & flags
        emulated = kernels != "torch" and _DTYPE_NEEDS["bfloat16"][0] & flags
        return "bfloat16" if native or emulated else "float32"
    dtype = parse_dtype(requested)
    check_dtype_supported(dtype, flags)
    return dtype


def check_dtype_supported(dtype: str, flags: frozenset[str]) -> None:
    needs, names = _DTYPE_NEEDS[dtype]
    if needs and not needs & flags:
        raise ConfigError(f"dtype {dtype} needs {names}, which this CPU lacks: use --dtype float32")
