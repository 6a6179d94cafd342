"""Data-parallel replicas placed by the binding plan, on fabricated topologies."""

from __future__ import annotations

import pytest
from fake_sysfs import GiB, Machine, discover, write_cgroup_v2

from cpud.model.load import load_model_config
from cpud.placement.memory_plan import FRONTEND_BYTES, plan_memory
from cpud.placement.replicas import plan_replicas
from cpud.placement.topology import discover_topology
from cpud.settings.errors import ConfigError

# Two nodes of 16 cores (SMT2): big enough for the default reservation of one core per rank.
TWO_NODES = Machine(sockets=2, cores_per_node=16, smt=2)
FOUR_NODES = Machine(sockets=2, nodes_per_socket=2, cores_per_node=16, smt=2)
# Like this machine: one node, two cores.
SMALL = Machine(cores_per_node=2)


def rank_cpus(replica):
    return [r.cpus for r in replica.binding.ranks]


def test_two_nodes_dp2_tp2_one_replica_per_node(tmp_path):
    topo = discover(tmp_path, TWO_NODES)
    plan = plan_replicas(None, None, 2, 2, topo, port=9000)
    first, second = plan.replicas
    assert first.numa_nodes == (0,) and second.numa_nodes == (1,)
    # each node's 16 cores split between the replica's two ranks (too few to reserve one)
    assert rank_cpus(first) == [tuple(range(0, 8)), tuple(range(8, 16))]
    assert rank_cpus(second) == [tuple(range(16, 24)), tuple(range(24, 32))]
    assert [r.rank for r in second.binding.ranks] == [0, 1]  # renumbered inside the replica
    # the frontends run on the SMT siblings of their own replica's node
    assert first.binding.frontend_cpus == tuple(range(32, 48))
    assert second.binding.frontend_cpus == tuple(range(48, 64))
    assert first.binding.frontend_placement == "smt-siblings"
    assert (first.port, second.port) == (9000, 9001)
    assert (first.url, second.url) == ("http://127.0.0.1:9000", "http://127.0.0.1:9001")
    # two ranks of one replica share each node: that is --tp's own warning
    assert any("share NUMA node 0" in w for w in plan.binding.all_warnings)
    assert any(
        line.startswith("replica 1: 2 rank(s) on NUMA node(s) 1") for line in plan.describe()
    )


def test_two_nodes_reserved_cores_go_to_the_replica_on_their_node(tmp_path):
    topo = discover(tmp_path, TWO_NODES)
    first, second = plan_replicas(None, 1, 2, 2, topo).replicas
    assert rank_cpus(first) == [tuple(range(0, 7)), tuple(range(7, 14))]
    assert first.binding.frontend_cpus == (14, 15, 46, 47)
    assert second.binding.frontend_cpus == (30, 31, 62, 63)
    assert first.binding.frontend_placement == "reserved"


def test_two_replicas_on_one_node_split_its_reserved_cores(tmp_path):
    one_node = Machine(cores_per_node=16)
    first, second = plan_replicas(None, 2, 1, 2, discover(tmp_path, one_node)).replicas
    assert rank_cpus(first) == [tuple(range(0, 6))] and rank_cpus(second) == [tuple(range(6, 12))]
    assert first.binding.frontend_cpus == (12, 13) and second.binding.frontend_cpus == (14, 15)


def test_four_nodes_dp2_tp2_one_replica_per_node_pair(tmp_path):
    topo = discover(tmp_path, FOUR_NODES)
    plan = plan_replicas(None, None, 2, 2, topo)
    first, second = plan.replicas
    assert first.numa_nodes == (0, 1) and second.numa_nodes == (2, 3)
    assert rank_cpus(first) == [tuple(range(0, 15)), tuple(range(16, 31))]
    assert rank_cpus(second) == [tuple(range(32, 47)), tuple(range(48, 63))]
    assert first.binding.frontend_cpus == (15, 31, 79, 95)
    assert second.binding.frontend_cpus == (47, 63, 111, 127)
    assert plan.binding.all_warnings == ()
    # each replica's memory view: its nodes whole (one rank per node, no other replica there)
    assert first.topology.node(0).mem_available == topo.node(0).mem_available


def test_four_nodes_dp4_tp1(tmp_path):
    topo = discover(tmp_path, FOUR_NODES)
    plan = plan_replicas(None, None, 1, 4, topo)
    assert [r.numa_nodes for r in plan.replicas] == [(0,), (1,), (2,), (3,)]
    assert [r.port for r in plan.replicas] == [8000, 8001, 8002, 8003]


def test_one_node_split_evenly_with_a_warning(tmp_path):
    topo = discover(tmp_path, SMALL)
    plan = plan_replicas(None, None, 1, 2, topo)
    first, second = plan.replicas
    assert rank_cpus(first) == [(0,)] and rank_cpus(second) == [(1,)]
    assert any("share NUMA node 0" in w for w in plan.binding.all_warnings)
    # no spare core: each replica's frontend shares its own rank's CPU
    assert first.binding.frontend_cpus == (0,) and first.binding.frontend_placement == "shared"
    assert second.binding.frontend_cpus == (1,)
    # each replica may plan half of the node's memory
    assert first.topology.node(0).mem_available == topo.node(0).mem_available // 2


def test_more_replicas_than_cores_is_refused(tmp_path):
    topo = discover(tmp_path, SMALL)
    with pytest.raises(ConfigError, match=r"x --tp 2 = 4 ranks.*needs one physical core per rank"):
        plan_replicas(None, None, 2, 2, topo)


def test_explicit_lists_one_per_rank_replica_by_replica(tmp_path):
    topo = discover(tmp_path, TWO_NODES)
    plan = plan_replicas("0-3|4-7|16-19|20-23", None, 2, 2, topo)
    assert rank_cpus(plan.replicas[1]) == [(16, 17, 18, 19), (20, 21, 22, 23)]
    with pytest.raises(ConfigError, match="gives 2 CPU list.* x --tp 2 runs 4"):
        plan_replicas("0-3|16-19", None, 2, 2, topo)


def test_nobind_replicas_share_memory_evenly(tmp_path):
    topo = discover(tmp_path, TWO_NODES)
    plan = plan_replicas("nobind", None, 1, 2, topo)
    assert all(r.binding.mode == "nobind" for r in plan.replicas)
    assert plan.replicas[0].binding.frontend_cpus == ()
    total = sum(n.mem_available for n in topo.nodes)
    assert sum(n.mem_available for n in plan.replicas[1].topology.nodes) == pytest.approx(
        total / 2, abs=4
    )


def test_router_puts_replicas_on_loopback_ports_above_its_own(tmp_path):
    topo = discover(tmp_path, TWO_NODES)
    plan = plan_replicas(None, None, 1, 2, topo, host="0.0.0.0", port=8000, router=True)
    assert [r.url for r in plan.replicas] == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert (plan.router_host, plan.router_port, plan.router_metrics_port) == ("0.0.0.0", 8000, 8003)
    with pytest.raises(ConfigError, match="past 65535: lower --port"):
        plan_replicas(None, None, 1, 2, topo, port=65534, router=True)


@pytest.mark.parametrize("dp", [0, -1, True])
def test_bad_sizes_are_refused(tmp_path, dp):
    topo = discover(tmp_path, TWO_NODES)
    with pytest.raises(ConfigError, match="--data-parallel-size must be a positive"):
        plan_replicas(None, None, 1, dp, topo)


def test_each_replica_plans_its_share_of_a_cgroup(tmp_path, model_factory):
    sys_root, proc_root = tmp_path / "sys", tmp_path / "proc"
    discover(tmp_path, SMALL)
    limit = 8 * GiB
    write_cgroup_v2(
        sys_root,
        proc_root,
        "/svc",
        {"/svc": {"memory.max": str(limit), "memory.current": "0"}},
    )
    topo = discover_topology(sys_root, proc_root=proc_root, allowed_cpus=SMALL.cpus)
    plan = plan_replicas(None, None, 1, 2, topo)
    view = plan.replicas[0].topology
    assert view.cgroup_memory_available == (topo.cgroup_memory_available - FRONTEND_BYTES) // 2
    model = load_model_config(model_factory("qwen3"))
    memory = plan_memory(
        model, "float32", plan.replicas[0].binding, view, max_model_len=256, kv_cache_fraction=0.5
    )
    (rank,) = memory.ranks
    assert "shared by 1 rank(s)" in rank.budget_source
    assert rank.budget_bytes <= limit // 2
