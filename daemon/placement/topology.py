"""CPU and NUMA topology from sysfs, as far as this process may use it.

Everything is read from roots given as parameters (sysfs, procfs, cgroupfs) so tests run on
fabricated trees. Discovery intersects the machine with what the process is allowed: its CPU
affinity (cgroup cpusets land there), its allowed memory nodes (cpuset.mems) and its cgroup
memory limit.

Available memory of a node is estimated as MemFree + Active(file) + Inactive(file) +
SReclaimable: free pages plus page cache and slab the kernel can reclaim (per-node meminfo has no
MemAvailable; vLLM's CPU worker uses the same sum). Shmem/tmpfs pages sit on the anon LRU, so
they are not counted as reclaimable.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cpud.placement.cpulist import format_cpulist, parse_cpulist
from cpud.settings.errors import ConfigError

# cgroup v1 reports "no limit" as a huge page-aligned number (LONG_MAX rounded down).
_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class NumaNode:
    id: int
    # Allowed online CPUs grouped by physical core: each group is one core's SMT siblings,
    # sorted; groups sorted by their first CPU.
    cores: tuple[tuple[int, ...], ...]
    mem_total: int
    mem_available: int
    # False when cpuset.mems forbids allocating on this node.
    mem_allowed: bool = True

    @property
    def cpus(self) -> tuple[int, ...]:
        return tuple(sorted(cpu for core in self.cores for cpu in core))

    @property
    def physical_cores(self) -> tuple[int, ...]:
        """One representative CPU per physical core: the lowest allowed SMT sibling."""
        return tuple(core[0] for core in self.cores)


@dataclass(frozen=True)
class Topology:
    nodes: tuple[NumaNode, ...]
    online_cpus: frozenset[int]
    allowed_cpus: frozenset[int]
    # Tightest cgroup memory.max on the way to the root, and the room left under it.
    cgroup_memory_limit: int | None = None
    cgroup_memory_available: int | None = None
    # False when the kernel exposes no NUMA nodes and node 0 was synthesized.
    numa: bool = True

    def node(self, node_id: int) -> NumaNode:
        for node in self.nodes:
            if node.id == node_id:
                return node
        raise KeyError(node_id)

    @property
    def node_ids(self) -> tuple[int, ...]:
        return tuple(node.id for node in self.nodes)

    def node_of(self, cpu: int) -> int | None:
        for node in self.nodes:
            if any(cpu in core for core in node.cores):
                return node.id
        return None

    def core_of(self, cpu: int) -> tuple[int, ...]:
        """The allowed SMT siblings of `cpu`'s physical core (including cpu)."""
        for node in self.nodes:
            for core in node.cores:
                if cpu in core:
                    return core
        return (cpu,)

    def describe(self) -> str:
        parts = [
            f"node {n.id}: CPUs {format_cpulist(n.cpus) or '-'} "
            f"({len(n.cores)} cores), {n.mem_available / (1 << 30):.1f}/"
            f"{n.mem_total / (1 << 30):.1f} GiB available"
            for n in self.nodes
        ]
        if self.cgroup_memory_limit is not None:
            parts.append(f"cgroup memory limit {self.cgroup_memory_limit / (1 << 30):.1f} GiB")
        return "; ".join(parts)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _read_cpulist(path: Path) -> tuple[int, ...] | None:
    text = _read(path)
    return None if text is None else parse_cpulist(text, str(path))


def _read_int(path: Path) -> int | None:
    text = _read(path)
    try:
        return None if text is None else int(text.strip())
    except ValueError:
        return None


def _meminfo_kib(text: str) -> dict[str, int]:
    """'Node 0 MemFree:  123 kB' or 'MemFree:  123 kB' lines -> {'MemFree': bytes}."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        match = re.match(r"(?:Node \d+ )?([^:\s]+):\s+(\d+)(?:\s+kB)?\s*$", line)
        if match:
            values[match[1]] = int(match[2]) * 1024
    return values


def _node_available(info: dict[str, int]) -> int:
    if "Active(file)" in info and "Inactive(file)" in info:
        cache = info["Active(file)"] + info["Inactive(file)"]
    else:
        cache = info.get("FilePages", 0) - info.get("Shmem", 0)
    return info.get("MemFree", 0) + max(cache, 0) + info.get("SReclaimable", 0)


def _core_groups(
    cpu_dir: Path, cpus: Iterable[int], usable: frozenset[int]
) -> list[tuple[int, ...]]:
    """Group `cpus` by physical core, keeping only `usable` siblings."""
    groups: dict[object, set[int]] = {}
    for cpu in cpus:
        topo = cpu_dir / f"cpu{cpu}" / "topology"
        siblings = _read_cpulist(topo / "thread_siblings_list") or _read_cpulist(
            topo / "core_cpus_list"
        )
        if siblings:
            key: object = frozenset(siblings)
        else:
            package = _read_int(topo / "physical_package_id")
            if package is None:
                package = _read_int(topo / "package_id")
            core_id = _read_int(topo / "core_id")
            key = ("cpu", cpu) if core_id is None else (package, core_id)
        groups.setdefault(key, set()).add(cpu)
    cores = [tuple(sorted(g & usable)) for g in groups.values()]
    return sorted((c for c in cores if c), key=lambda c: c[0])


def _allowed_mems(proc_root: Path) -> frozenset[int] | None:
    text = _read(proc_root / "self" / "status") or ""
    for line in text.splitlines():
        if line.startswith("Mems_allowed_list:"):
            return frozenset(parse_cpulist(line.split(":", 1)[1], "Mems_allowed_list"))
    return None


def _cgroup_paths(proc_root: Path) -> tuple[str | None, str | None]:
    """(cgroup v2 path, cgroup v1 memory controller path) of this process."""
    v2 = v1 = None
    for line in (_read(proc_root / "self" / "cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _stat_reclaimable(stat_text: str | None, prefix: str = "") -> int:
    values = {}
    for line in (stat_text or "").splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            values[key] = int(value)
    return sum(values.get(f"{prefix}{k}", 0) for k in ("active_file", "inactive_file"))


def _walk_up(leaf: Path, top: Path) -> list[Path]:
    levels = [leaf]
    while levels[-1] != top and top in levels[-1].parents:
        levels.append(levels[-1].parent)
    return levels


def _cgroup_memory(cgroup_root: Path, proc_root: Path) -> tuple[int | None, int | None]:
    """(limit, room left) over the memory cgroup and its ancestors; (None, None) if unlimited.

    Room = limit - (usage - reclaimable page cache), the tightest over all limited levels.
    """
    v2, v1 = _cgroup_paths(proc_root)
    candidates: list[tuple[Path, Path, str, str, str]] = []
    if v2 is not None:
        top = cgroup_root
        candidates.append((top / v2.lstrip("/"), top, "memory.max", "memory.current", ""))
    if v1 is not None:
        top = cgroup_root / "memory"
        leaf = top / v1.lstrip("/")
        # Inside a cgroup namespace the v1 mount root is already this process's cgroup.
        leaf = leaf if leaf.is_dir() else top
        candidates.append((leaf, top, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_"))
    for leaf, top, limit_file, usage_file, stat_prefix in candidates:
        limit = room = None
        for level in _walk_up(leaf, top):
            text = _read(level / limit_file)
            if text is None or text.strip() == "max":
                continue
            try:
                value = int(text.strip())
            except ValueError:
                continue
            if value >= _UNLIMITED:
                continue
            usage = _read_int(level / usage_file) or 0
            reclaimable = _stat_reclaimable(_read(level / "memory.stat"), stat_prefix)
            level_room = max(0, value - max(0, usage - reclaimable))
            limit = value if limit is None else min(limit, value)
            room = level_room if room is None else min(room, level_room)
        if limit is not None:
            return limit, room
    return None, None


def discover_topology(
    sysfs_root: str | os.PathLike = "/sys",
    *,
    proc_root: str | os.PathLike = "/proc",
    cgroup_root: str | os.PathLike | None = None,
    allowed_cpus: Iterable[int] | None = None,
    allowed_mems: Iterable[int] | None = None,
) -> Topology:
    """The NUMA nodes, cores and memory this process may use.

    allowed_cpus defaults to sched_getaffinity(0); allowed_mems to Mems_allowed_list of
    <proc_root>/self/status; cgroup_root to <sysfs_root>/fs/cgroup.
    """
    sysfs = Path(sysfs_root)
    proc = Path(proc_root)
    cpu_dir = sysfs / "devices" / "system" / "cpu"
    node_dir = sysfs / "devices" / "system" / "node"

    online = _read_cpulist(cpu_dir / "online")
    if online is None:
        found = [p.name[3:] for p in cpu_dir.glob("cpu[0-9]*")] if cpu_dir.is_dir() else []
        online = tuple(sorted(int(n) for n in found if n.isdigit()))
    if not online:
        raise ConfigError(f"no online CPUs found under {cpu_dir}: is {sysfs} a sysfs mount?")
    online_set = frozenset(online)
    if allowed_cpus is None:
        allowed_cpus = os.sched_getaffinity(0)
    usable = online_set & frozenset(allowed_cpus)
    if not usable:
        raise ConfigError(
            f"none of the allowed CPUs is online (online: {format_cpulist(online_set)}): "
            f"check the cpuset or taskset of this process"
        )
    mems = frozenset(allowed_mems) if allowed_mems is not None else _allowed_mems(proc)

    node_paths = sorted(
        (int(p.name[4:]), p) for p in node_dir.glob("node[0-9]*") if p.name[4:].isdigit()
    )
    nodes: list[NumaNode] = []
    if node_paths:
        for node_id, path in node_paths:
            cpus = [c for c in (_read_cpulist(path / "cpulist") or ()) if c in online_set]
            info = _meminfo_kib(_read(path / "meminfo") or "")
            nodes.append(
                NumaNode(
                    id=node_id,
                    cores=tuple(_core_groups(cpu_dir, cpus, usable)),
                    mem_total=info.get("MemTotal", 0),
                    mem_available=_node_available(info),
                    mem_allowed=mems is None or node_id in mems,
                )
            )
    else:
        info = _meminfo_kib(_read(proc / "meminfo") or "")
        available = info.get("MemAvailable", _node_available(info))
        cores = tuple(_core_groups(cpu_dir, online, usable))
        nodes.append(NumaNode(0, cores, info.get("MemTotal", 0), available))

    limit, room = _cgroup_memory(
        Path(cgroup_root) if cgroup_root is not None else sysfs / "fs" / "cgroup", proc
    )
    return Topology(
        nodes=tuple(nodes),
        online_cpus=online_set,
        allowed_cpus=usable,
        cgroup_memory_limit=limit,
        cgroup_memory_available=room,
        numa=bool(node_paths),
    )
