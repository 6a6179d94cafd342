"""The GGUF formats cpud loads, read from ``quant_formats.h``: the X-macro table the C kernels
compile from, parsed here at import, so Python's sizes and codes are the kernels' own.

    FORMATS["Q4_K"].block_bytes        # 144: bytes of 256 values in the file
    KERNEL_FORMATS["Q4_K"].code        # 3: enum cpud_qtype
    FLOAT_TYPES, SUPPORTED_TYPES

Neither torch nor the compiled library is imported: the control processes size weights and
check files with it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

TABLE = Path(__file__).parent / "drivers" / "quant_formats.h"
FAMILIES = ("b32", "k45", "q6k", "e2m1")  # quant_kernels.h blk_<family>


@dataclass(frozen=True)
class QuantFormat:
    """A GGUF type cpud reads: kind "float" (loaded as-is), "dequant" (dequantized at load) or
    "kernel" (a KernelFormat, run in its blocks by the quantized GEMM)."""

    name: str
    kind: str
    ggml_type: int  # gguf's GGMLQuantizationType value
    block_values: int
    block_bytes: int


@dataclass(frozen=True)
class KernelFormat(QuantFormat):
    """A block type the quantized GEMM runs on, with its packed layout (quant_formats.h)."""

    code: int  # enum cpud_qtype
    qbytes: int  # packed quants per block of 16 rows
    sbytes: int  # packed scales per block of 16 rows
    family: str
    scale_values: int
    mins: bool
    bf16_min_m: int


_ENTRY = re.compile(r"(CPUD_(?:FLOAT|DEQUANT|KERNEL)_FORMAT)\((.*)\)")


def _entry(macro: str, args: list[str]) -> QuantFormat:
    name, nums = args[0], args[1:]
    if macro == "CPUD_FLOAT_FORMAT":
        ggml_type, size = map(int, nums)
        return QuantFormat(name, "float", ggml_type, 1, size)
    if macro == "CPUD_DEQUANT_FORMAT":
        return QuantFormat(name, "dequant", *map(int, nums))
    ggml_type, values, size, code, qbytes, sbytes = map(int, nums[:6])
    family, (scale_values, mins, min_m) = nums[6], map(int, nums[7:])
    if family not in FAMILIES:
        raise ValueError(f"family {family!r} is not one of {', '.join(FAMILIES)}")
    return KernelFormat(
        name, "kernel", ggml_type, values, size, code, qbytes, sbytes, family, scale_values,
        bool(mins), min_m,
    )  # fmt: skip


def _check(formats: list[QuantFormat]) -> None:
    for field in ("name", "ggml_type"):
        seen = [getattr(f, field) for f in formats]
        if len(set(seen)) != len(seen):
            raise ValueError(f"a {field} appears twice: {seen}")
    codes = sorted(f.code for f in formats if isinstance(f, KernelFormat))
    if codes != list(range(len(codes))):
        raise ValueError(f"kernel codes must run 0, 1, ... unbroken, got {codes}")
    for f in formats:
        if f.block_values < 1 or f.block_bytes < 1:
            raise ValueError(f"{f.name}: block sizes must be positive")


def parse_formats(text: str) -> dict[str, QuantFormat]:
    """The formats of a quant_formats.h text by name, in table order; ValueError naming the line
    for anything outside comments and preprocessor lines that is not one whole entry."""
    formats = []
    code = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group().count("\n"), text, flags=re.S)
    directive = False  # within a preprocessor line continued by backslashes
    for number, line in enumerate(code.splitlines(), 1):
        line = line.strip()
        if directive or line.startswith("#"):
            directive = line.endswith("\\")
            continue
        if not line:
            continue
        match = _ENTRY.fullmatch(line)
        try:
            if match is None:
                raise ValueError("not one CPUD_*_FORMAT(...) entry")
            formats.append(_entry(match[1], [a.strip() for a in match[2].split(",")]))
        except (IndexError, TypeError, ValueError) as exc:
            raise ValueError(f"{TABLE.name} line {number}: {exc}: {line!r}") from None
    _check(formats)
    return {f.name: f for f in formats}


FORMATS: dict[str, QuantFormat] = parse_formats(TABLE.read_text())
KERNEL_FORMATS: dict[str, KernelFormat] = {
    f.name: f
    for f in sorted(FORMATS.values(), key=lambda f: getattr(f, "code", -1))
    if isinstance(f, KernelFormat)
}
FLOAT_TYPES: frozenset[str] = frozenset(n for n, f in FORMATS.items() if f.kind == "float")
SUPPORTED_TYPES: tuple[str, ...] = tuple(FORMATS)


__all__ = [
    "FLOAT_TYPES",
    "FORMATS",
    "KERNEL_FORMATS",
    "SUPPORTED_TYPES",
    "KernelFormat",
    "QuantFormat",
    "parse_formats",
]
