"""`cpud doctor`: what this machine gives cpud, each item with a verdict and what to change."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch

from cpud import __version__
from cpud.ranks.cpu_features import cpu_flags, resolve_dtype


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    value: object
    advice: str = ""


def native_check() -> Check:
    from cpud import native

    info = native.info()
    if not info["available"]:
        return Check(
            "native kernels",
            False,
            info,
            "not built: install gcc >= 10 and reinstall (pip install -e .); cpud runs on the "
            "slower torch path meanwhile",
        )
    lowered = info["isa"] != info["detected_isa"]
    advice = "CPUD_ISA lowers the tier below what this CPU runs" if lowered else ""
    return Check("native kernels", True, info, advice)


def dtype_check() -> Check:
    chosen = str(resolve_dtype("auto")).removeprefix("torch.")
    flags = cpu_flags()
    native_bf16 = bool({"avx512_bf16", "amx_bf16"} & flags)
    advice = "" if native_bf16 else "no AVX512-BF16/AMX: auto picks float32 (twice the memory)"
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16") if f in flags]
    return Check("default dtype", True, {"auto": chosen, "cpu_flags": isa}, advice)


def threads_check() -> Check:
    allowed = len(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    ok = threads == allowed
    advice = "" if ok else f"torch uses {threads} threads on {allowed} allowed CPUs"
    return Check("threads", ok, {"allowed_cpus": allowed, "torch_threads": threads}, advice)


def collect() -> list[Check]:
    return [
        Check("cpud", True, {"version": __version__, "torch": torch.__version__}),
        native_check(),
        dtype_check(),
        threads_check(),
    ]


def report(checks: list[Check]) -> dict:
    return {"ok": all(c.ok for c in checks), "checks": [asdict(c) for c in checks]}


def render(checks: list[Check]) -> str:
    lines = []
    for check in checks:
        mark = "ok  " if check.ok else "FAIL"
        lines.append(f"[{mark}] {check.name}: {check.value}")
        if check.advice:
            lines.append(f"       -> {check.advice}")
    return "\n".join(lines)
