"""Topology discovery on fabricated sysfs trees, and invariants on this machine's /sys."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
from fake_sysfs import GiB, Machine, discover, write_cgroup_v1, write_cgroup_v2, write_machine

from cpud.placement.topology import discover_topology
from cpud.settings.errors import ConfigError

TWO_SOCKETS = Machine(sockets=2, nodes_per_socket=2, cores_per_node=4, smt=2)


def test_two_sockets_two_nodes_smt2(tmp_path):
    topo = discover(tmp_path, TWO_SOCKETS)
    assert topo.numa
    assert topo.node_ids == (0, 1, 2, 3)
    node1 = topo.node(1)
    # cores 4-7, their siblings 20-23
    assert node1.physical_cores == (4, 5, 6, 7)
    assert node1.cores == ((4, 20), (5, 21), (6, 22), (7, 23))
    assert node1.cpus == (4, 5, 6, 7, 20, 21, 22, 23)
    assert node1.mem_total == 64 * GiB
    assert node1.mem_available == TWO_SOCKETS.available_bytes
    assert topo.node_of(22) == 1
    assert topo.core_of(22) == (6, 22)
    assert topo.allowed_cpus == frozenset(range(32))
    assert topo.cgroup_memory_limit is None
    assert topo.describe().startswith("node 0: CPUs 0-3,16-19 (4 cores), 53.0/64.0 GiB available")


def test_eight_nodes(tmp_path):
    topo = discover(tmp_path, Machine(sockets=2, nodes_per_socket=4, cores_per_node=6, smt=2))
    assert topo.node_ids == tuple(range(8))
    assert all(len(node.cores) == 6 for node in topo.nodes)
    assert topo.node(7).physical_cores == tuple(range(42, 48))


def test_offline_cpus(tmp_path):
    # CPU 21 is one SMT thread of core 5; core 6 is entirely offline.
    topo = discover(tmp_path, replace(TWO_SOCKETS, offline=(21, 6, 22)))
    node1 = topo.node(1)
    assert node1.cores == ((4, 20), (5,), (7, 23))
    assert node1.physical_cores == (4, 5, 7)
    assert 21 not in topo.online_cpus and 6 not in topo.allowed_cpus


def test_cpuset_narrower_than_node(tmp_path):
    allowed = [0, 1, 16, 17, 4, 5, 6, 7]  # two cores with siblings on node 0, node 1 without
    topo = discover(tmp_path, TWO_SOCKETS, allowed=allowed)
    assert topo.node(0).cores == ((0, 16), (1, 17))
    assert topo.node(1).cores == ((4,), (5,), (6,), (7,))
    assert topo.node(2).cores == ()
    assert topo.allowed_cpus == frozenset(allowed)


def test_node_without_cpus(tmp_path):
    topo = discover(tmp_path, Machine(sockets=1, cores_per_node=4, memory_only_nodes=1))
    assert topo.node_ids == (0, 1)
    assert topo.node(1).cores == ()
    assert topo.node(1).mem_total == 64 * GiB


def test_non_numa_kernel_is_one_node(tmp_path):
    m = Machine(cores_per_node=4, smt=2, numa=False)
    topo = discover(tmp_path, m)
    assert not topo.numa
    assert topo.node_ids == (0,)
    assert topo.node(0).physical_cores == (0, 1, 2, 3)
    assert topo.node(0).mem_available == m.available_bytes  # /proc/meminfo MemAvailable


def test_core_id_fallback_without_sibling_lists(tmp_path):
    m = Machine(cores_per_node=2, smt=2)
    sys_root, proc_root = write_machine(tmp_path, m)
    for cpu in m.cpus:
        (sys_root / f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").unlink()
    topo = discover_topology(sys_root, proc_root=proc_root, allowed_cpus=m.cpus)
    assert topo.node(0).cores == ((0, 2), (1, 3))


def test_mems_allowed_from_proc_status(tmp_path):
    sys_root, proc_root = write_machine(tmp_path, TWO_SOCKETS)
    (proc_root / "self/status").write_text("Mems_allowed_list:\t0,2\n")
    topo = discover_topology(sys_root, proc_root=proc_root, allowed_cpus=range(32))
    assert [n.mem_allowed for n in topo.nodes] == [True, False, True, False]


def test_no_allowed_cpu_online(tmp_path):
    with pytest.raises(ConfigError, match="none of the allowed CPUs is online"):
        discover(tmp_path, Machine(cores_per_node=2, offline=(1,)), allowed=[1])


def test_cgroup_v2_memory_max(tmp_path):
    sys_root, proc_root = write_machine(tmp_path, TWO_SOCKETS)
    stat = "anon 100\nactive_file 1073741824\ninactive_file 1073741824\n"
    write_cgroup_v2(
        sys_root,
        proc_root,
        "/system.slice/cpud.service",
        {
            "/system.slice": {"memory.max": str(24 * GiB), "memory.current": str(2 * GiB)},
            "/system.slice/cpud.service": {
                "memory.max": str(16 * GiB),
                "memory.current": str(3 * GiB),
                "memory.stat": stat,
            },
        },
    )
    topo = discover_topology(sys_root, proc_root=proc_root, allowed_cpus=range(32))
    assert topo.cgroup_memory_limit == 16 * GiB
    # 16 GiB - (3 GiB used - 2 GiB reclaimable page cache); the parent has 22 GiB left.
    assert topo.cgroup_memory_available == 15 * GiB


def test_cgroup_v2_parent_is_tighter_and_max_is_unlimited(tmp_path):
    sys_root, proc_root = write_machine(tmp_path, TWO_SOCKETS)
    write_cgroup_v2(
        sys_root,
        proc_root,
        "/a/b",
        {
            "/a": {"memory.max": str(8 * GiB), "memory.current": str(6 * GiB)},
            "/a/b": {"memory.max": "max", "memory.current": str(1 * GiB)},
        },
    )
    topo = discover_topology(sys_root, proc_root=proc_root, allowed_cpus=range(32))
    assert topo.cgroup_memory_limit == 8 * GiB
    assert topo.cgroup_memory_available == 2 * GiB


def test_cgroup_v2_unlimited(tmp_path):
    sys_root, proc_root = write_machine(tmp_path, TWO_SOCKETS)
    write_cgroup_v2(sys_root, proc_root, "/user", {"/user": {"memory.max": "max"}})
    topo = discover_topology(sys_root, proc_root=proc_root, allowed_cpus=range(32))
    assert topo.cgroup_memory_limit is None and topo.cgroup_memory_available is None


def test_cgroup_v1_fallback(tmp_path):
    sys_root, proc_root = write_machine(tmp_path, TWO_SOCKETS)
    write_cgroup_v1(
        sys_root,
        proc_root,
        "/docker/abc",
        {
            "/": {"memory.limit_in_bytes": "9223372036854771712"},
            "/docker/abc": {
                "memory.limit_in_bytes": str(4 * GiB),
                "memory.usage_in_bytes": str(1 * GiB),
                "memory.stat": "cache 5\ntotal_active_file 0\ntotal_inactive_file 536870912\n",
            },
        },
    )
    topo = discover_topology(sys_root, proc_root=proc_root, allowed_cpus=range(32))
    assert topo.cgroup_memory_limit == 4 * GiB
    assert topo.cgroup_memory_available == 4 * GiB - GiB // 2


def test_cgroup_v1_namespaced_mount(tmp_path):
    # Inside a cgroup namespace the mount root is the container's own cgroup.
    sys_root, proc_root = write_machine(tmp_path, TWO_SOCKETS)
    write_cgroup_v1(
        sys_root, proc_root, "/kubepods/pod1", {"/": {"memory.limit_in_bytes": str(2 * GiB)}}
    )
    topo = discover_topology(sys_root, proc_root=proc_root, allowed_cpus=range(32))
    assert topo.cgroup_memory_limit == 2 * GiB


def test_this_machine_invariants():
    topo = discover_topology()
    affinity = os.sched_getaffinity(0)
    assert topo.nodes, "at least one node"
    assert topo.allowed_cpus <= affinity and topo.allowed_cpus <= topo.online_cpus
    seen: set[int] = set()
    for node in topo.nodes:
        assert set(node.cpus) <= topo.allowed_cpus
        assert not seen & set(node.cpus), "a CPU belongs to one node"
        seen |= set(node.cpus)
        assert len(node.physical_cores) == len(node.cores)
        assert all(core[0] == min(core) for core in node.cores)
        assert 0 < node.mem_available <= node.mem_total
    assert seen == topo.allowed_cpus
    if topo.cgroup_memory_limit is not None:
        assert 0 <= topo.cgroup_memory_available <= topo.cgroup_memory_limit
