"""The threading runtime of this process: exactly one OpenMP library mapped once torch and the
native kernels are loaded, and torch's thread count against the CPUs it may use."""

from __future__ import annotations

import os
import re
from pathlib import Path

from cpud.doctor.planning import Failed, Planning
from cpud.doctor.report import Check

# libgomp (GNU, torch's bundled copy included), libiomp5 (Intel), libomp (LLVM); wheels
# vendor them with a hash suffix (libgomp-a34b3233.so.1).
_OPENMP = re.compile(r"^lib(gomp|iomp5|iomp5md|omp)(-[0-9a-f]+)?\.so")


def openmp_runtimes(maps_text: str) -> list[str]:
    """Distinct OpenMP library files in a /proc/<pid>/maps text, in order of appearance."""
    found: list[str] = []
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        path = fields[5].removesuffix(" (deleted)")
        if _OPENMP.match(os.path.basename(path)) and path not in found:
            found.append(path)
    return found


def openmp_check(proc_root: Path) -> Check:
    import torch  # noqa: F401  (what serving loads, in serving's order: torch first)

    from cpud import native

    maps = proc_root / "self/maps"
    try:
        runtimes = openmp_runtimes(maps.read_text())
    except OSError as exc:
        return Check(
            "openmp",
            "warn",
            f"cannot read {maps}: {exc.strerror}",
            {"runtimes": None},
            (f"mount procfs at {proc_root} to let cpud check its OpenMP runtime",),
        )
    value = {"runtimes": runtimes, "native_loaded": native.available()}
    if len(runtimes) == 1:
        return Check("openmp", "ok", f"one runtime: {runtimes[0]}", value)
    if not runtimes:
        return Check(
            "openmp",
            "warn",
            "no OpenMP runtime mapped: torch and the native kernels run single-threaded",
            value,
            ("install a torch build with OpenMP (the official CPU wheels have it)",),
        )
    return Check(
        "openmp",
        "fail",
        f"{len(runtimes)} runtimes mapped: {', '.join(runtimes)}",
        value,
        (
            "two OpenMP runtimes in one process keep two thread pools that fight over the cores "
            "and ignore each other's pinning: keep torch's alone (remove LD_PRELOAD of "
            "libiomp5/libgomp, and reinstall cpud after torch so the native library links the "
            "libgomp torch loads)",
        ),
    )


def threads_check(planning: Planning) -> Check:
    import torch

    topology, affinity = planning.topology, planning.affinity
    if not isinstance(topology, Failed):
        allowed = len(topology.allowed_cpus)
        cores = sum(len(node.cores) for node in topology.nodes)
    elif not isinstance(affinity, Failed):
        allowed = cores = len(affinity)
    else:
        allowed = cores = os.cpu_count() or 1
    threads = torch.get_num_threads()
    env = os.environ.get("OMP_NUM_THREADS")
    value = {
        "torch_threads": threads,
        "allowed_cpus": allowed,
        "physical_cores": cores,
        "OMP_NUM_THREADS": env,
    }
    summary = f"torch uses {threads} threads on {allowed} allowed CPUs ({cores} physical cores)"
    details = (
        "bound ranks run one thread per CPU of their plan; this count applies to --bind nobind "
        "ranks and to the offline API at --tp 1",
    )
    if threads > allowed:
        advice = (
            f"more threads than allowed CPUs oversubscribe them: unset OMP_NUM_THREADS "
            f"(now {env}) or set it to {cores} at most",
        )
        return Check("threads", "warn", summary, value, advice, details)
    if threads < cores:
        advice = (
            f"fewer threads than physical cores leave cores idle at --tp 1: unset "
            f"OMP_NUM_THREADS (now {env}) or set it to {cores}",
        )
        return Check("threads", "warn", summary, value, advice, details)
    return Check("threads", "ok", summary, value, details=details)
