"""Where each rank and the frontend would run: the binding plan of --bind/--tp/--reserved-cpus
and the vLLM environment variables, with what to change when it is not one rank per node and
one thread per physical core."""

from __future__ import annotations

import os

from cpud.doctor.inputs import DoctorInputs
from cpud.doctor.planning import Failed, Planning
from cpud.doctor.report import Check
from cpud.placement.binding import BIND_ENV, RESERVED_ENV, VISIBLE_NODES_ENV, BindingPlan
from cpud.placement.cpulist import format_cpulist
from cpud.placement.topology import Topology
from cpud.settings.config import EngineArgs


def bind_given(args: EngineArgs) -> str:
    """The bind setting as the operator gave it (the flag wins over the env var)."""
    if args.bind is not None:
        return f"--bind {args.bind}"
    if os.environ.get(BIND_ENV, "").strip():
        return f"{BIND_ENV}={os.environ[BIND_ENV]}"
    return "--bind auto (default)"


def cross_rank_siblings(binding: BindingPlan, topology: Topology) -> list[str]:
    """Warnings for physical cores whose SMT siblings belong to different ranks (the planner
    already warns about siblings inside one rank's list), one per group of ranks."""
    users: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for rank in binding.ranks:
        for cpu in rank.cpus:
            users.setdefault(topology.core_of(cpu), []).append((rank.rank, cpu))
    by_ranks: dict[frozenset[int], set[int]] = {}
    for threads in users.values():
        ranks = frozenset(rank for rank, _ in threads)
        if len(ranks) > 1:
            by_ranks.setdefault(ranks, set()).update(cpu for _, cpu in threads)
    return [
        f"ranks {format_cpulist(ranks)} run threads on SMT siblings of the same physical cores "
        f"(CPUs {format_cpulist(cpus)}): they compete for those cores"
        for ranks, cpus in sorted(by_ranks.items(), key=lambda item: min(item[1]))
    ]


def _siblings_in_rank(binding: BindingPlan, topology: Topology) -> bool:
    return any(
        len(set(topology.core_of(cpu)) & set(rank.cpus)) > 1
        for rank in binding.ranks
        for cpu in rank.cpus
    )


def _spans_nodes(binding: BindingPlan, topology: Topology) -> bool:
    return any(len({topology.node_of(cpu) for cpu in rank.cpus}) > 1 for rank in binding.ranks)


def _usable_nodes(topology: Topology) -> int:
    return sum(1 for node in topology.nodes if node.cores and node.mem_allowed)


def _plan_value(binding: BindingPlan, given: str) -> dict[str, object]:
    return {
        "bind": given,
        "mode": binding.mode,
        "tp": binding.tp,
        "ranks": [
            {
                "rank": r.rank,
                "numa_node": r.numa_node,
                "cpus": format_cpulist(r.cpus),
                "threads": len(r.cpus),
            }
            for r in binding.ranks
        ],
        "frontend": {
            "cpus": format_cpulist(binding.frontend_cpus),
            "placement": binding.frontend_placement,
        },
    }


def _summary(binding: BindingPlan, given: str) -> str:
    nodes = sorted({r.numa_node for r in binding.ranks if r.numa_node is not None})
    threads = sorted({len(r.cpus) for r in binding.ranks})
    where = f"on NUMA node(s) {format_cpulist(nodes)}" if nodes else "unbound"
    per_rank = str(threads[0]) if len(threads) == 1 else f"{threads[0]}-{threads[-1]}"
    count = f"{per_rank} thread(s) each" if threads != [0] else "threads not pinned"
    frontend = format_cpulist(binding.frontend_cpus) or "not pinned"
    return (
        f"{given}, --tp {binding.tp}: {binding.tp} rank(s) {where}, {count}; "
        f"frontend on CPUs {frontend} ({binding.frontend_placement})"
    )


def binding_check(inputs: DoctorInputs, planning: Planning) -> Check:
    args = inputs.engine
    given = bind_given(args)
    binding, topology, spec = planning.binding, planning.topology, planning.spec
    if isinstance(binding, Failed):
        value = {"bind": given, "tp": args.tp, "error": binding.reason}
        if binding.upstream:
            return Check(
                "binding",
                "warn",
                f"not planned ({binding.reason})",
                value,
                ("fix the failed numa item first",),
            )
        return Check(
            "binding",
            "fail",
            f"{given} with --tp {args.tp} cannot be planned",
            value,
            (binding.reason,),
        )
    assert not isinstance(topology, Failed) and not isinstance(spec, Failed)

    extra = cross_rank_siblings(binding, topology)
    advice: list[str] = []
    shared_nodes = sorted(
        {
            n
            for r in binding.ranks
            if (n := r.numa_node) is not None and binding.ranks_on_node(n) > 1
        }
    )
    usable = _usable_nodes(topology)
    if shared_nodes and binding.mode == "explicit" and binding.tp <= usable:
        advice.append(
            f"ranks share NUMA node(s) {format_cpulist(shared_nodes)}: give each rank CPUs of a "
            f"different node in --bind / {BIND_ENV} (or use --bind auto)"
        )
    elif shared_nodes:
        advice.append(
            f"ranks share NUMA node(s) {format_cpulist(shared_nodes)}, splitting their cores and "
            f"memory bandwidth: --tp {usable} (one rank per usable NUMA node) gives each rank a "
            f"node of its own"
        )
    if extra or _siblings_in_rank(binding, topology):
        advice.append(f"list one CPU per physical core in --bind / {BIND_ENV}, or use --bind auto")
    if _spans_nodes(binding, topology):
        advice.append(f"keep each rank's CPU list inside one NUMA node (--bind / {BIND_ENV})")
    if len({len(r.cpus) for r in binding.ranks}) > 1:
        advice.append(
            "give every rank the same number of cores (equal --bind lists, or --tp / "
            f"{VISIBLE_NODES_ENV} choosing nodes of equal size)"
        )
    if binding.mode == "nobind":
        extra.append("nobind: rank threads are not pinned and rank memory is not bound")
        advice.append(
            "--bind auto pins one thread per physical core and binds each rank's memory to its "
            "NUMA node"
        )
        cores = sum(len(node.cores) for node in topology.nodes)
        if binding.tp > 1 and not os.environ.get("OMP_NUM_THREADS", "").strip():
            extra.append(
                f"nobind without OMP_NUM_THREADS: each of the {binding.tp} ranks starts torch's "
                f"default threads (one per core), oversubscribing the cores {binding.tp} times"
            )
            advice.append(f"OMP_NUM_THREADS={max(1, cores // binding.tp)} splits the cores")
    elif binding.frontend_shares:
        if binding.frontend_placement == "smt-siblings":
            extra.append("the frontend has no core of its own: it runs on SMT siblings of ranks")
        if binding.mode == "explicit":
            advice.append(f"leave a core of each rank's node out of the --bind / {BIND_ENV} lists")
        elif not spec.reserved:
            advice.append(
                f"--reserved-cpus 1 ({RESERVED_ENV}=1) keeps one core per rank for the frontend"
            )
    if not advice:
        advice = list(binding.all_warnings)
    value = _plan_value(binding, given) | {
        "reserved_cpus": spec.reserved,
        "visible_nodes": None if spec.visible_nodes is None else list(spec.visible_nodes),
        "warnings": list(binding.all_warnings) + extra,
        "notes": list(binding.notes),
    }
    details = binding.describe() + [f"warning: {w}" for w in extra]
    if spec.visible_nodes is not None:
        details.append(f"note: {VISIBLE_NODES_ENV}={','.join(map(str, spec.visible_nodes))}")
    status = "warn" if advice or value["warnings"] else "ok"
    return Check("binding", status, _summary(binding, given), value, tuple(advice), tuple(details))
