"""What the processor is: model and vendor, the native kernels' ISA tier, the dtype `auto`
picks, and SMT."""

from __future__ import annotations

import platform
from pathlib import Path

from cpud.doctor.inputs import DoctorInputs
from cpud.doctor.planning import Failed, Planning
from cpud.doctor.report import Check
from cpud.model.cpu_features import cpu_flags, resolve_dtype
from cpud.placement.cpulist import format_cpulist, parse_cpulist
from cpud.settings.errors import CpudError

# flags that decide kernels and dtypes, in the order people know them
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16", "amx_fp16")


def _cpuinfo_fields(path: Path) -> dict[str, str]:
    """The first processor's 'key : value' lines of /proc/cpuinfo."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def _read_ints(paths: list[Path]) -> list[int]:
    values = []
    for path in paths:
        try:
            values.append(int(path.read_text().strip()))
        except (OSError, ValueError):
            continue
    return values


def _online(sysfs_root: Path) -> tuple[int, ...]:
    try:
        return parse_cpulist((sysfs_root / "devices/system/cpu/online").read_text())
    except (OSError, CpudError):
        return ()


def _threads_per_core(cpu_dir: Path, online: tuple[int, ...]) -> int:
    most = 1
    for cpu in online:
        try:
            siblings = (cpu_dir / f"cpu{cpu}/topology/thread_siblings_list").read_text()
            most = max(most, len(parse_cpulist(siblings)))
        except (OSError, CpudError):
            continue
    return most


def cpu_check(inputs: DoctorInputs) -> Check:
    info = _cpuinfo_fields(inputs.proc_root / "cpuinfo")
    flags = frozenset(info.get("flags", "").split())
    online = _online(inputs.sysfs_root)
    cpu_dir = inputs.sysfs_root / "devices/system/cpu"
    packages = set(_read_ints([cpu_dir / f"cpu{c}/topology/physical_package_id" for c in online]))
    value = {
        "model": info.get("model name", "unknown"),
        "vendor": info.get("vendor_id", "unknown"),
        "architecture": platform.machine(),
        "sockets": len(packages) or None,
        "online_cpus": format_cpulist(online),
        "isa_flags": [f for f in ISA_FLAGS if f in flags],
    }
    sockets = f"{len(packages)} socket{'s' * (len(packages) != 1)}, " if packages else ""
    summary = (
        f"{value['model']} ({value['vendor']}), {sockets}{len(online)} CPUs online; "
        f"{' '.join(value['isa_flags']) or 'no AVX2/AVX-512'}"
    )
    if not info:
        return Check(
            "cpu",
            "warn",
            summary,
            value,
            (f"{inputs.proc_root / 'cpuinfo'} is unreadable: ISA and dtype choices are unknown",),
        )
    return Check("cpu", "ok", summary, value)


def native_check(inputs: DoctorInputs) -> Check:
    from cpud import native

    info = native.info()
    if not info["available"]:
        return Check(
            "native kernels",
            "warn",
            f"not built ({info['error']}): cpud runs on the slower torch path",
            info,
            ("install gcc >= 10 and reinstall cpud (pip install -e .) to build them",),
        )
    summary = f"ISA tier {info['isa']} (best this CPU runs: {info['detected_isa']})"
    if info["isa"] != info["detected_isa"]:
        advice = (
            f"CPUD_ISA lowers the tier below what this CPU runs: unset it to use "
            f"{info['detected_isa']}"
        )
        return Check("native kernels", "warn", summary, info, (advice,))
    flags = cpu_flags(str(inputs.proc_root / "cpuinfo"))
    if {"amx_tile", "amx_bf16"} <= flags and info["detected_isa"] != "amx":
        advice = (
            "this CPU has AMX but the kernel did not grant cpud its tile data "
            "(arch_prctl ARCH_REQ_XCOMP_PERM needs Linux >= 5.16 and no seccomp filter on it): "
            "batched GEMMs run several times slower on the avx512bf16 tier"
        )
        return Check("native kernels", "warn", summary, info, (advice,))
    return Check("native kernels", "ok", summary, info)


# CPU flag -> ISA on which cpud's kernels emulate bf16 (weights widened to fp32), best first.
_BF16_EMULATION = (("avx512f", "AVX-512"), ("avx2", "AVX2"))


def dtype_check(inputs: DoctorInputs) -> Check:
    flags = cpu_flags(str(inputs.proc_root / "cpuinfo"))
    auto = str(resolve_dtype("auto", flags, kernels=inputs.engine.kernels)).removeprefix("torch.")
    requested = inputs.engine.dtype
    value: dict[str, object] = {
        "auto": auto,
        "requested": requested,
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
        "avx512_fp16": "avx512_fp16" in flags,
    }
    try:
        chosen = str(resolve_dtype(requested, flags, kernels=inputs.engine.kernels)).removeprefix(
            "torch."
        )
    except CpudError as exc:
        value["error"] = str(exc)
        return Check("dtype", "fail", f"--dtype {requested}: {exc}", value, (str(exc),))
    value["chosen"] = chosen
    native = [name for name in ("AVX512-BF16", "AMX-BF16") if value[name.lower().replace("-", "_")]]
    summary = f"--dtype {requested} -> {chosen} (native bf16: {', '.join(native) or 'none'})"
    emulates = next((name for flag, name in _BF16_EMULATION if flag in flags), None)
    if chosen == "float32" and emulates:
        return Check(
            "dtype",
            "warn",
            summary,
            value,
            (
                "float32 weights take twice the memory and bandwidth of bfloat16: --dtype "
                f"bfloat16 runs on {emulates} here (emulated, slower per FLOP than AVX512-BF16)",
            ),
        )
    return Check("dtype", "ok", summary, value)


def smt_check(inputs: DoctorInputs, planning: Planning) -> Check:
    cpu_dir = inputs.sysfs_root / "devices/system/cpu"
    online = _online(inputs.sysfs_root)
    per_core = _threads_per_core(cpu_dir, online)
    try:
        control = (cpu_dir / "smt/control").read_text().strip()
    except OSError:
        control = None
    value: dict[str, object] = {"threads_per_core": per_core, "smt_control": control}
    summary = f"{per_core} thread{'s' * (per_core != 1)} per core"
    summary += f" (SMT {control})" if control else ""
    topology = planning.topology
    if not isinstance(topology, Failed):
        cores = sum(len(node.cores) for node in topology.nodes)
        value |= {"physical_cores_visible": cores, "cpus_visible": len(topology.allowed_cpus)}
        summary += f"; {cores} physical cores and {len(topology.allowed_cpus)} CPUs visible"
    details = ()
    if per_core > 1:
        details = (
            "--bind auto runs one thread per physical core; the other SMT siblings stay idle "
            "or host the frontend",
        )
    return Check("smt", "ok", summary, value, details=details)


THP_ADVICE = (
    "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled (as root; a sysctl.d or "
    "kernel command line transparent_hugepage=madvise keeps it): cpud asks for 2 MiB pages "
    "for its weights, which decode reads ~20-30 % faster than 4 KiB pages"
)


def huge_pages_check(inputs: DoctorInputs) -> Check:
    """Transparent huge pages: the ranks advise their packed weights MADV_HUGEPAGE, honoured in
    the `always` and `madvise` modes."""
    path = inputs.sysfs_root / "kernel/mm/transparent_hugepage/enabled"
    try:
        text = path.read_text().strip()
    except OSError:
        summary = f"transparent huge pages unavailable ({path} unreadable): weights on 4 KiB pages"
        return Check("huge pages", "warn", summary, {"mode": None}, (THP_ADVICE,))
    mode = next((w[1:-1] for w in text.split() if w.startswith("[")), text)
    value = {"mode": mode}
    if mode in ("always", "madvise"):
        return Check(
            "huge pages", "ok", f"transparent huge pages {mode}: weights on 2 MiB pages", value
        )
    summary = f"transparent huge pages {mode}: weights stay on 4 KiB pages"
    return Check("huge pages", "warn", summary, value, (THP_ADVICE,))
