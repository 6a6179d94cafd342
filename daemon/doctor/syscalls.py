"""The scheduling and NUMA system calls ranks make, issued here in harmless forms.

Ranks set their CPU affinity and bind their memory with set_mempolicy (ranks/binding.py).
Containers and seccomp filters often deny these with EPERM; ranks then warn and run unbound.
The doctor asks the kernel the same questions without changing anything: get_mempolicy,
set_mempolicy(MPOL_DEFAULT) (this short-lived process keeps the default policy) and
sched_setaffinity to the mask it already has.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from cpud.doctor.report import Check
from cpud.ranks.binding import SYS_SET_MEMPOLICY

SYS_GET_MEMPOLICY = 239  # x86-64, next to SYS_SET_MEMPOLICY
MPOL_DEFAULT = 0
_MPOL_MODES = ("default", "preferred", "bind", "interleave", "local", "preferred_many")
_MPOL_MODE_MASK = 0xFF  # the rest of the word holds MPOL_F_* flags


class NumaSyscalls(Protocol):
    """What the doctor asks the kernel; each call raises OSError when the kernel says no."""

    def affinity(self) -> frozenset[int]: ...

    def set_affinity(self, cpus: frozenset[int]) -> None: ...

    def get_mempolicy(self) -> int: ...

    def set_mempolicy_default(self) -> None: ...


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def get_mempolicy() -> int:
    """This thread's memory policy mode (MPOL_*, flags masked off)."""
    mode = ctypes.c_int(0)
    rc = _libc().syscall(
        SYS_GET_MEMPOLICY, ctypes.byref(mode), None, ctypes.c_ulong(0), None, ctypes.c_ulong(0)
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"get_mempolicy: {os.strerror(err)}")
    return mode.value & _MPOL_MODE_MASK


def set_mempolicy_default() -> None:
    rc = _libc().syscall(SYS_SET_MEMPOLICY, MPOL_DEFAULT, None, ctypes.c_ulong(0))
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"set_mempolicy(MPOL_DEFAULT): {os.strerror(err)}")


@dataclass(frozen=True)
class LibcNumaSyscalls:
    """The real calls (methods look the module functions up at call time, so tests can
    monkeypatch the one that issues a syscall)."""

    def affinity(self) -> frozenset[int]:
        return frozenset(os.sched_getaffinity(0))

    def set_affinity(self, cpus: frozenset[int]) -> None:
        os.sched_setaffinity(0, cpus)

    def get_mempolicy(self) -> int:
        return get_mempolicy()

    def set_mempolicy_default(self) -> None:
        set_mempolicy_default()


_MEMPOLICY_ADVICE = (
    "memory binding is denied, so ranks allocate wherever the kernel puts pages (remote NUMA "
    "memory, less bandwidth): allow get_mempolicy/set_mempolicy/mbind: docker or podman "
    "--cap-add SYS_NICE (or a seccomp profile that allows them); systemd: keep @resources in "
    "SystemCallFilter= (deploy/cpud.service); Kubernetes: add SYS_NICE to the container's "
    "securityContext.capabilities"
)
_AFFINITY_ADVICE = (
    "CPU pinning is denied, so rank threads float between cores: allow sched_setaffinity "
    "(systemd: keep @resources in SystemCallFilter=; containers: a seccomp profile that allows "
    "it), or set --bind nobind (VLLM_CPU_OMP_THREADS_BIND=nobind) to stop asking"
)
_NO_NUMA_KERNEL = (
    "this kernel has no NUMA support (ENOSYS): memory binding is off, which only matters on a "
    "machine with several NUMA nodes"
)


def _attempt(call: Callable[[], object]) -> tuple[str, object]:
    """('permitted', result) or (errno name / error text, None); never raises."""
    try:
        return "permitted", call()
    except OSError as exc:
        return (errno.errorcode.get(exc.errno, str(exc.errno)) if exc.errno else str(exc)), None
    except Exception as exc:  # a diagnostic never crashes: report what went wrong
        return f"error: {type(exc).__name__}: {exc}", None


def numa_syscalls_check(syscalls: NumaSyscalls) -> Check:
    mask_verdict, mask = _attempt(syscalls.affinity)
    results: dict[str, str] = {"sched_getaffinity": mask_verdict}
    results["get_mempolicy"], mode = _attempt(syscalls.get_mempolicy)
    results["set_mempolicy"], _ = _attempt(syscalls.set_mempolicy_default)
    if isinstance(mask, frozenset):
        results["sched_setaffinity"], _ = _attempt(lambda: syscalls.set_affinity(mask))
    else:
        results["sched_setaffinity"] = "not tried: the current mask is unknown"
    denied = {name: verdict for name, verdict in results.items() if verdict != "permitted"}
    policy = _MPOL_MODES[mode] if isinstance(mode, int) and mode < len(_MPOL_MODES) else mode
    value = {"calls": results, "memory_policy": policy}
    if not denied:
        return Check(
            "numa syscalls",
            "ok",
            f"{', '.join(results)} permitted (memory policy now: {policy})",
            value,
        )
    advice = []
    if denied.keys() & {"get_mempolicy", "set_mempolicy"}:
        no_numa = all(denied.get(n) in (None, "ENOSYS") for n in ("get_mempolicy", "set_mempolicy"))
        advice.append(_NO_NUMA_KERNEL if no_numa else _MEMPOLICY_ADVICE)
    if denied.keys() & {"sched_getaffinity", "sched_setaffinity"}:
        advice.append(_AFFINITY_ADVICE)
    summary = "denied: " + ", ".join(f"{name} ({verdict})" for name, verdict in denied.items())
    return Check("numa syscalls", "warn", summary, value, tuple(advice))
