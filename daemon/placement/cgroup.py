"""The cpuset this process's cgroup grants: CPUs and memory nodes (cgroup v2, else v1).

Read from a cgroupfs root and a procfs root given as parameters so tests fabricate them. The
memory limit is topology.discover_topology's job (it walks every ancestor); this module answers
only the cpuset side. Inside a cgroup namespace the mount root is the process's own cgroup,
so a path from /proc/self/cgroup that does not exist under the root falls back to the root.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from cpud.placement.cpulist import parse_cpulist


@dataclass(frozen=True)
class CgroupCpuset:
    version: int
    # the process's cgroup as /proc/self/cgroup names it (v1: the cpuset controller's)
    path: str
    # cpuset.cpus.effective (v1: cpuset.effective_cpus)
    cpus: tuple[int, ...]
    # cpuset.mems.effective (v1: cpuset.effective_mems); None when unreadable
    mems: tuple[int, ...] | None


def cgroup_membership(proc_root: str | os.PathLike) -> tuple[str | None, dict[str, str]]:
    """(cgroup v2 path, {v1 controller: path}) of this process from <proc_root>/self/cgroup."""
    try:
        text = (Path(proc_root) / "self" / "cgroup").read_text()
    except OSError:
        return None, {}
    v2: str | None = None
    v1: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and not controllers:
            v2 = path
        for controller in filter(None, controllers.split(",")):
            v1[controller] = path
    return v2, v1


def _read_list(path: Path) -> tuple[int, ...] | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    return parse_cpulist(text, str(path)) or None


def _levels(leaf: Path, top: Path) -> list[Path]:
    """leaf, its parent, ... up to top (the leaf alone falls back to top when it is missing)."""
    if not leaf.is_dir():
        return [top]
    levels = [leaf]
    while levels[-1] != top and top in levels[-1].parents:
        levels.append(levels[-1].parent)
    return levels


def read_cpuset(
    cgroup_root: str | os.PathLike, proc_root: str | os.PathLike = "/proc"
) -> CgroupCpuset | None:
    """The effective cpuset of this process's cgroup, or None where no cpuset can be read.

    In v2 a cgroup without the cpuset controller enabled has no cpuset files: the nearest
    ancestor that has them decides.
    """
    root = Path(cgroup_root)
    v2, v1 = cgroup_membership(proc_root)
    if v2 is not None:
        for level in _levels(root / v2.lstrip("/"), root):
            cpus = _read_list(level / "cpuset.cpus.effective")
            if cpus is not None:
                return CgroupCpuset(2, v2, cpus, _read_list(level / "cpuset.mems.effective"))
    if "cpuset" in v1:
        top = root / "cpuset"
        for level in _levels(top / v1["cpuset"].lstrip("/"), top):
            cpus = _read_list(level / "cpuset.effective_cpus") or _read_list(level / "cpuset.cpus")
            if cpus is not None:
                mems = _read_list(level / "cpuset.effective_mems") or _read_list(
                    level / "cpuset.mems"
                )
                return CgroupCpuset(1, v1["cpuset"], cpus, mems)
    return None
