"""Put this process where the plan says, before torch allocates anything: CPU affinity,
memory policy bound to one NUMA node, then one OpenMP thread pinned per CPU."""

from __future__ import annotations

import ctypes
import errno
import logging
import os

from cpud.process.parent_death import die_with_parent  # noqa: F401  (the worker's, from here)
from cpud.ranks.libc import libc

log = logging.getLogger("cpud.rank")

MPOL_BIND = 2
SYS_SET_MEMPOLICY = 238  # x86-64


def set_affinity(cpus: list[int]) -> str | None:
    """Every thread of the process (sched_setaffinity(0) alone moves only the caller); returns
    a warning instead of failing where the syscall is not permitted (seccomp, containers)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            pass
        except PermissionError as exc:
            return f"sched_setaffinity to CPUs {cpus} is not permitted here ({exc}): unpinned"
    return None


def bind_memory(node: int) -> str | None:
    """MPOL_BIND to `node` for every later allocation; returns a warning instead of failing
    where the syscall is not permitted (containers)."""
    words = node // 64 + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // 64] = 1 << (node % 64)
    rc = libc().syscall(SYS_SET_MEMPOLICY, MPOL_BIND, mask, ctypes.c_ulong(words * 64 + 1))
    if rc == 0:
        return None
    err = ctypes.get_errno()
    if err in (errno.EPERM, errno.ENOSYS):
        return (
            f"set_mempolicy(MPOL_BIND, node {node}) is not permitted here "
            f"({errno.errorcode[err]}): memory is not bound to the rank's node"
        )
    raise OSError(err, f"set_mempolicy(node {node}) failed: {os.strerror(err)}")


def pin_threads(cpus: list[int]) -> list[int]:
    """One OpenMP thread per CPU, each pinned to its own; returns where each one ran."""
    import torch

    torch.set_num_threads(len(cpus))
    from cpud import native

    if not native.available():
        return []
    return native.pin_threads(cpus)
