"""Binding spec parsing and rank placement on fabricated topologies."""

from __future__ import annotations

from dataclasses import replace

import pytest
from fake_sysfs import Machine, discover

from cpud.placement.binding import (
    BIND_ENV,
    RESERVED_ENV,
    VISIBLE_NODES_ENV,
    BindingSpec,
    binding_spec,
    plan_binding,
)
from cpud.placement.topology import discover_topology
from cpud.settings.errors import ConfigError

# 2 sockets x 2 NUMA nodes x 4 cores x SMT2: node n has cores 4n..4n+3, siblings +16.
TWO_SOCKETS = Machine(sockets=2, nodes_per_socket=2, cores_per_node=4, smt=2)
# The same shape with 16 cores per node (siblings +64): big enough for the default reservation.
BIG = Machine(sockets=2, nodes_per_socket=2, cores_per_node=16, smt=2)
# Like this machine: one node, two cores, no SMT.
SMALL = Machine(cores_per_node=2)


def plan(tmp_path, machine, tp, bind=None, reserved=None, visible=None, allowed=None, mems=None):
    topo = discover(tmp_path, machine, allowed=allowed, allowed_mems=mems)
    return plan_binding(binding_spec(bind, reserved, visible, env={}), tp, topo)


def cpus(p):
    return [r.cpus for r in p.ranks]


def nodes(p):
    return [r.numa_node for r in p.ranks]


def error(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as err:
        fn(*args, **kwargs)
    message = str(err.value)
    assert "\n" not in message, message
    return message


# --- the spec ------------------------------------------------------------------------------


def test_spec_defaults_env_and_flag_override():
    assert binding_spec(env={}) == BindingSpec()
    env = {BIND_ENV: "0-3|4-7", RESERVED_ENV: "2", VISIBLE_NODES_ENV: "1,0"}
    spec = binding_spec(env=env)
    assert spec.mode == "explicit" and spec.cpu_lists == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert spec.reserved == 2 and spec.visible_nodes == (1, 0)
    assert spec.bind_source == BIND_ENV and spec.reserved_source == RESERVED_ENV
    flags = binding_spec(bind="nobind", reserved=0, visible_nodes="0", env=env)
    assert (flags.mode, flags.reserved, flags.visible_nodes) == ("nobind", 0, (0,))
    assert binding_spec(bind=" AUTO ", env={}).mode == "auto"
    assert binding_spec(bind="0,2,4-7|8-15", env={}).cpu_lists == (
        (0, 2, 4, 5, 6, 7),
        tuple(range(8, 16)),
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bind": "0-3|"}, "--bind='0-3|': rank 1's CPU list is empty"),
        ({"bind": "0-3||4-7"}, "rank 1's CPU list is empty: give one non-empty CPU list"),
        ({"bind": "0-3|4-"}, "rank 1's CPU list '4-': range '4-' has no end"),
        ({"bind": "0-3|7-4"}, "range '7-4' runs backwards; write 4-7"),
        ({"bind": "all"}, "'all' is not a number"),
        ({"bind": "0,,1"}, "empty item between commas"),
        ({"bind": "-1"}, "is negative"),
        ({"reserved": "-1"}, "--reserved-cpus='-1': expected a whole number of CPUs >= 0"),
        ({"reserved": "one"}, "expected a whole number"),
        ({"visible_nodes": "1,1"}, "1 appears more than once"),
        ({"visible_nodes": "x"}, "CPU_VISIBLE_MEMORY_NODES='x'"),
    ],
)
def test_spec_errors(kwargs, message):
    assert message in error(binding_spec, env={}, **kwargs)


def test_spec_errors_name_the_env_var():
    message = error(binding_spec, env={BIND_ENV: "0-3|"})
    assert message.startswith(f"{BIND_ENV}='0-3|'")
    assert RESERVED_ENV in error(binding_spec, env={RESERVED_ENV: "x"})


# --- auto ----------------------------------------------------------------------------------


def test_auto_two_sockets_reserves_last_core_of_each_node(tmp_path):
    p = plan(tmp_path, BIG, tp=4)
    assert nodes(p) == [0, 1, 2, 3]
    # one thread per physical core (the lower SMT sibling), the node's last core reserved
    assert cpus(p) == [tuple(range(16 * n, 16 * n + 15)) for n in range(4)]
    assert p.frontend_cpus == (15, 31, 47, 63, 79, 95, 111, 127)
    assert p.frontend_placement == "reserved" and not p.frontend_shares
    assert p.all_warnings == ()


def test_auto_small_nodes_keep_every_core_frontend_on_siblings(tmp_path):
    p = plan(tmp_path, TWO_SOCKETS, tp=4)
    assert cpus(p) == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)]
    assert p.frontend_cpus == tuple(range(16, 32))
    assert p.frontend_placement == "smt-siblings" and p.frontend_shares
    assert any("no core reserved for the frontend by default" in n for n in p.notes)


def test_reserved_cpus(tmp_path):
    p = plan(tmp_path, TWO_SOCKETS, tp=4, reserved=1)
    assert cpus(p) == [(0, 1, 2), (4, 5, 6), (8, 9, 10), (12, 13, 14)]
    assert p.frontend_cpus == (3, 7, 11, 15, 19, 23, 27, 31)
    assert p.frontend_placement == "reserved"
    p = plan(tmp_path, TWO_SOCKETS, tp=4, reserved=2)
    assert cpus(p)[1] == (4, 5) and p.frontend_cpus[:4] == (2, 3, 6, 7)
    p = plan(tmp_path, BIG, tp=4, reserved=0)
    assert all(len(c) == 16 for c in cpus(p)) and p.frontend_placement == "smt-siblings"


def test_reserved_more_than_fits_is_reduced(tmp_path):
    p = plan(tmp_path, TWO_SOCKETS, tp=4, reserved=4)
    assert cpus(p)[0] == (0,)
    assert any("--reserved-cpus=4 would leave a rank without a core" in w for w in p.warnings)


def test_eight_nodes(tmp_path):
    m = Machine(sockets=2, nodes_per_socket=4, cores_per_node=6, smt=2)
    p = plan(tmp_path, m, tp=8)
    assert nodes(p) == list(range(8))
    assert cpus(p)[7] == tuple(range(42, 48))
    p = plan(tmp_path, m, tp=16)
    assert nodes(p) == [n for n in range(8) for _ in range(2)]
    assert cpus(p)[:2] == [(0, 1, 2), (3, 4, 5)]
    assert sum("share NUMA node" in w for w in p.warnings) == 8


def test_tp_below_nodes_uses_the_first_nodes(tmp_path):
    p = plan(tmp_path, TWO_SOCKETS, tp=2)
    assert nodes(p) == [0, 1]
    assert any("--tp 2 uses NUMA node(s) 0,1 of the 4 usable nodes" in n for n in p.notes)
    # the frontend stays on the nodes that hold ranks
    assert p.frontend_cpus == tuple(range(16, 24))


def test_tp2_on_one_two_core_node(tmp_path):
    p = plan(tmp_path, SMALL, tp=2)
    assert cpus(p) == [(0,), (1,)] and nodes(p) == [0, 0]
    assert any("ranks 0-1 share NUMA node 0: each gets 1 of its 2 cores" in w for w in p.warnings)
    assert p.frontend_placement == "shared" and p.frontend_cpus == (0, 1)
    assert any("too small to reserve a core" in w for w in p.warnings)
    p = plan(tmp_path, SMALL, tp=1)
    assert cpus(p) == [(0, 1)] and p.frontend_placement == "shared"


def test_too_small_to_reserve(tmp_path):
    p = plan(tmp_path, SMALL, tp=2, reserved=1)
    assert cpus(p) == [(0,), (1,)] and p.frontend_placement == "shared"
    assert any("reserving 0 CPU(s) per rank instead" in w for w in p.warnings)
    p = plan(tmp_path, SMALL, tp=1, reserved=1)
    assert cpus(p) == [(0,)] and p.frontend_cpus == (1,) and p.frontend_placement == "reserved"


def test_more_ranks_than_nodes_uneven(tmp_path):
    p = plan(tmp_path, Machine(sockets=2, cores_per_node=4), tp=3)
    assert cpus(p) == [(0, 1), (2, 3), (4, 5, 6, 7)] and nodes(p) == [0, 0, 1]
    assert any("unequal thread counts (2, 2, 4)" in w for w in p.warnings)


def test_more_ranks_than_cores(tmp_path):
    message = error(plan, tmp_path, SMALL, tp=3)
    assert "node 0 has 2 usable core(s) for 3 rank(s): lower --tp to 2" in message


def test_visible_nodes_reorder_and_restrict(tmp_path):
    p = plan(tmp_path, TWO_SOCKETS, tp=2, visible="1,0")
    assert nodes(p) == [1, 0] and cpus(p) == [(4, 5, 6, 7), (0, 1, 2, 3)]
    p = plan(tmp_path, TWO_SOCKETS, tp=2, visible="2")
    assert nodes(p) == [2, 2]
    message = error(plan, tmp_path, TWO_SOCKETS, tp=1, visible="5")
    assert "names NUMA node(s) 5, but this machine has node(s) 0-3: list only existing" in message


def test_node_without_cpus_gets_no_rank(tmp_path):
    m = Machine(cores_per_node=4, memory_only_nodes=1)
    p = plan(tmp_path, m, tp=2)
    assert nodes(p) == [0, 0]
    assert any("NUMA node 1 has no CPU this process may use" in n for n in p.notes)
    message = error(plan, tmp_path, m, tp=1, visible="1")
    assert "no usable NUMA node has CPUs this process may use" in message


def test_cpuset_narrower_than_node(tmp_path):
    allowed = [0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 20, 21]
    p = plan(tmp_path, TWO_SOCKETS, tp=2, allowed=allowed)
    assert cpus(p) == [(0, 1, 2, 3), (4, 5)]
    assert any("unequal thread counts (4, 2)" in w for w in p.warnings)
    assert p.frontend_cpus == (16, 17, 18, 19, 20, 21)
    # a node entirely outside the cpuset gets no rank; 4 ranks go over the 3 others
    allowed = [c for c in range(32) if c not in (12, 13, 14, 15, 28, 29, 30, 31)]
    p = plan(tmp_path, TWO_SOCKETS, tp=4, allowed=allowed)
    assert nodes(p) == [0, 0, 1, 2]
    assert any("NUMA node 3 has no CPU" in n for n in p.notes)


def test_offline_cpus(tmp_path):
    p = plan(tmp_path, replace(TWO_SOCKETS, offline=(5, 21, 22)), tp=4)
    assert cpus(p)[1] == (4, 6, 7)
    assert 22 not in p.frontend_cpus and 21 not in p.frontend_cpus


def test_memory_nodes_outside_cpuset_mems(tmp_path):
    p = plan(tmp_path, TWO_SOCKETS, tp=4, mems=[0, 1])
    assert nodes(p) == [0, 0, 1, 1]
    assert any("NUMA node(s) 2-3 are outside" in n for n in p.notes)


# --- explicit lists ------------------------------------------------------------------------


def test_explicit_lists(tmp_path):
    p = plan(tmp_path, TWO_SOCKETS, tp=2, bind="0-3|4-7")
    assert p.mode == "explicit"
    assert cpus(p) == [(0, 1, 2, 3), (4, 5, 6, 7)] and nodes(p) == [0, 1]
    assert p.frontend_cpus == tuple(range(16, 24)) and p.frontend_placement == "smt-siblings"
    assert p.all_warnings == ()
    p = plan(tmp_path, TWO_SOCKETS, tp=2, bind="0-2|4-6")
    assert p.frontend_cpus == (3, 7, 19, 23) and p.frontend_placement == "reserved"


def test_explicit_list_spanning_nodes(tmp_path):
    p = plan(tmp_path, TWO_SOCKETS, tp=2, bind="0-5|6-7")
    assert nodes(p) == [0, 1]
    assert "rank 0's CPUs span NUMA nodes (4 on node 0, 2 on node 1)" in p.ranks[0].warnings[0]
    # a tie goes to the earlier visible node
    assert nodes(plan(tmp_path, TWO_SOCKETS, tp=1, bind="2-5")) == [0]
    assert nodes(plan(tmp_path, TWO_SOCKETS, tp=1, bind="2-5", visible="1,0")) == [1]


def test_explicit_smt_siblings_and_shared_node(tmp_path):
    p = plan(tmp_path, TWO_SOCKETS, tp=2, bind="0,16|1")
    assert "rank 0 has SMT siblings 0,16 in its list" in p.ranks[0].warnings[0]
    assert any("ranks 0,1 share NUMA node 0" in w for w in p.warnings)
    assert any("unequal thread counts (2, 1)" in w for w in p.warnings)


@pytest.mark.parametrize(
    ("bind", "tp", "allowed", "visible", "message"),
    [
        ("0-3|4-7", 4, None, None, "--bind gives 2 CPU list(s) but --tp is 4: give exactly one"),
        ("0-7", 2, None, None, "--bind gives 1 CPU list(s) but --tp is 2"),
        ("0-3|40", 2, None, None, "rank 1's list has CPU(s) 40, which are offline or absent"),
        (
            "0-3|4-7",
            2,
            [0, 1, 2, 3, 16, 17, 18, 19],
            None,
            "rank 1's list has CPU(s) 4-7, outside the CPUs this process may use (0-3,16-19",
        ),
        ("0-3|3-5", 2, None, None, "CPU(s) 3 appear in the lists of rank 0 and rank 1"),
        ("0-3|4-7", 2, None, "0", "rank 1's CPUs 4-7 are on NUMA node(s) 1, none of which"),
    ],
)
def test_explicit_errors(tmp_path, bind, tp, allowed, visible, message):
    assert message in error(plan, tmp_path, TWO_SOCKETS, tp, bind, None, visible, allowed)


def test_explicit_ignores_reserved(tmp_path):
    p = plan(tmp_path, TWO_SOCKETS, tp=2, bind="0-3|4-7", reserved=2)
    assert cpus(p) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert any("--reserved-cpus is not used with explicit lists" in n for n in p.notes)


# --- nobind and tp -------------------------------------------------------------------------


def test_nobind(tmp_path):
    p = plan(tmp_path, TWO_SOCKETS, tp=3, bind="nobind", reserved=1)
    assert cpus(p) == [(), (), ()] and nodes(p) == [None, None, None]
    assert p.frontend_cpus == () and p.frontend_placement == "unbound"
    assert any("nobind ignores" in n for n in p.notes)


@pytest.mark.parametrize("tp", [0, -1, True, 1.5])
def test_invalid_tp(tmp_path, tp):
    assert "--tp must be a positive whole number" in error(plan, tmp_path, SMALL, tp)


def test_describe(tmp_path):
    lines = plan(tmp_path, SMALL, tp=2).describe()
    assert lines[0] == "rank 0: NUMA node 0, 1 thread on CPUs 0"
    assert lines[2] == "frontend: CPUs 0-1 (shared)"
    assert any(line.startswith("warning: ranks 0-1 share NUMA node 0") for line in lines)


@pytest.mark.parametrize("tp", [1, 2])
def test_this_machine_invariants(tp):
    topo = discover_topology()
    cores = sum(len(node.cores) for node in topo.nodes)
    if tp > cores:
        pytest.skip(f"{cores} core(s) here")
    p = plan_binding(binding_spec(env={}), tp, topo)
    used = [cpu for rank in p.ranks for cpu in rank.cpus]
    assert len(p.ranks) == tp and all(rank.cpus for rank in p.ranks)
    assert len(used) == len(set(used)), "no CPU serves two ranks"
    assert set(used) <= topo.allowed_cpus
    for rank in p.ranks:
        assert rank.numa_node in topo.node_ids
        # one thread per physical core
        assert len({topo.core_of(cpu) for cpu in rank.cpus}) == len(rank.cpus)
    assert p.frontend_cpus and set(p.frontend_cpus) <= topo.allowed_cpus
    assert p.frontend_shares == bool(set(p.frontend_cpus) & set(used)) or (
        p.frontend_placement == "smt-siblings"
    )
