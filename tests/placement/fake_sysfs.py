"""Fabricated sysfs/procfs/cgroupfs trees from a compact machine description.

CPU numbering follows Linux on x86: logical CPU `t * total_cores + core` is SMT thread t of
physical core `core`, and node n owns cores [n * cores_per_node, (n + 1) * cores_per_node).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cpud.placement.cpulist import format_cpulist
from cpud.placement.topology import Topology, discover_topology

KiB = 1024
GiB = 1 << 30


@dataclass(frozen=True)
class Machine:
    sockets: int = 1
    nodes_per_socket: int = 1
    cores_per_node: int = 4
    smt: int = 1
    # extra nodes with memory but no CPUs (CXL, HBM), numbered after the CPU nodes
    memory_only_nodes: int = 0
    offline: tuple[int, ...] = ()
    mem_total_gib: int = 64
    mem_free_gib: int = 48
    # page cache (Active(file) + Inactive(file)) and reclaimable slab per node
    file_gib: int = 4
    sreclaimable_gib: int = 1
    # False: a kernel without NUMA (no devices/system/node)
    numa: bool = True

    @property
    def cpu_nodes(self) -> int:
        return self.sockets * self.nodes_per_socket

    @property
    def total_cores(self) -> int:
        return self.cpu_nodes * self.cores_per_node

    @property
    def cpus(self) -> list[int]:
        return list(range(self.total_cores * self.smt))

    def siblings(self, core: int) -> list[int]:
        return [t * self.total_cores + core for t in range(self.smt)]

    def node_cpus(self, node: int) -> list[int]:
        if node >= self.cpu_nodes:
            return []
        cores = range(node * self.cores_per_node, (node + 1) * self.cores_per_node)
        return sorted(cpu for core in cores for cpu in self.siblings(core))

    @property
    def available_bytes(self) -> int:
        """What discovery should estimate per node: free + page cache + reclaimable slab."""
        return (self.mem_free_gib + self.file_gib + self.sreclaimable_gib) * GiB


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _node_meminfo(node: int, m: Machine) -> str:
    half_file = m.file_gib * GiB // KiB // 2
    rows = {
        "MemTotal": m.mem_total_gib * GiB // KiB,
        "MemFree": m.mem_free_gib * GiB // KiB,
        "MemUsed": (m.mem_total_gib - m.mem_free_gib) * GiB // KiB,
        "Active(file)": half_file,
        "Inactive(file)": half_file,
        "FilePages": 2 * half_file + 1024,
        "Shmem": 1024,
        "SReclaimable": m.sreclaimable_gib * GiB // KiB,
    }
    lines = [f"Node {node} {key}:{value:>16} kB" for key, value in rows.items()]
    lines.append(f"Node {node} HugePages_Total:     0")
    return "\n".join(lines) + "\n"


def write_machine(root: Path, m: Machine) -> tuple[Path, Path]:
    """Write <root>/sys and <root>/proc for machine m; returns (sysfs root, procfs root)."""
    sys_root, proc_root = root / "sys", root / "proc"
    cpu_dir = sys_root / "devices" / "system" / "cpu"
    online = [c for c in m.cpus if c not in m.offline]
    _write(cpu_dir / "online", format_cpulist(online) + "\n")
    _write(cpu_dir / "possible", format_cpulist(m.cpus) + "\n")
    for cpu in online:
        core = cpu % m.total_cores
        topo = cpu_dir / f"cpu{cpu}" / "topology"
        _write(topo / "core_id", f"{core % m.cores_per_node}\n")
        package = core // (m.cores_per_node * m.nodes_per_socket)
        _write(topo / "physical_package_id", f"{package}\n")
        siblings = [c for c in m.siblings(core) if c not in m.offline]
        _write(topo / "thread_siblings_list", format_cpulist(siblings) + "\n")
    if m.numa:
        node_dir = sys_root / "devices" / "system" / "node"
        for node in range(m.cpu_nodes + m.memory_only_nodes):
            cpus = [c for c in m.node_cpus(node) if c not in m.offline]
            _write(node_dir / f"node{node}" / "cpulist", format_cpulist(cpus) + "\n")
            _write(node_dir / f"node{node}" / "meminfo", _node_meminfo(node, m))
    nodes = m.cpu_nodes + m.memory_only_nodes if m.numa else 1
    _write(
        proc_root / "meminfo",
        f"MemTotal: {m.mem_total_gib * GiB // KiB} kB\n"
        f"MemFree: {m.mem_free_gib * GiB // KiB} kB\n"
        f"MemAvailable: {m.available_bytes // KiB} kB\n",
    )
    _write(
        proc_root / "self" / "status",
        f"Name:\tpython\nMems_allowed_list:\t{format_cpulist(range(nodes))}\n",
    )
    _write(proc_root / "self" / "cgroup", "0::/\n")
    return sys_root, proc_root


def write_cgroup_v2(sys_root: Path, proc_root: Path, path: str, levels: dict[str, dict]) -> None:
    """cgroup v2 at <sys_root>/fs/cgroup; this process in `path`; `levels` maps a cgroup path
    to its files, e.g. {"/svc": {"memory.max": "8589934592", "memory.current": "0"}}."""
    base = sys_root / "fs" / "cgroup"
    _write(base / "cgroup.controllers", "cpuset cpu memory pids\n")
    for level, files in levels.items():
        for name, text in files.items():
            _write(base / level.lstrip("/") / name, text + "\n")
    _write(proc_root / "self" / "cgroup", f"0::{path}\n")


def write_cgroup_v1(sys_root: Path, proc_root: Path, path: str, levels: dict[str, dict]) -> None:
    """cgroup v1 memory controller at <sys_root>/fs/cgroup/memory (hybrid: v2 also listed)."""
    base = sys_root / "fs" / "cgroup" / "memory"
    for level, files in levels.items():
        for name, text in files.items():
            _write(base / level.lstrip("/") / name, text + "\n")
    _write(proc_root / "self" / "cgroup", f"4:memory:{path}\n3:cpuset:/\n0::/\n")


def discover(
    root: Path,
    m: Machine,
    allowed: Iterable[int] | None = None,
    allowed_mems: Iterable[int] | None = None,
) -> Topology:
    """Write machine m under root and discover it; every CPU allowed unless `allowed` says."""
    sys_root, proc_root = write_machine(root, m)
    return discover_topology(
        sys_root,
        proc_root=proc_root,
        allowed_cpus=m.cpus if allowed is None else allowed,
        allowed_mems=allowed_mems,
    )
