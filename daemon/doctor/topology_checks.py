"""NUMA nodes and cgroup limits as this process sees them."""

from __future__ import annotations

from cpud.doctor.inputs import DoctorInputs
from cpud.doctor.planning import Failed, Planning
from cpud.doctor.report import Check, gib
from cpud.placement.cgroup import cgroup_membership
from cpud.placement.cpulist import format_cpulist


def numa_check(planning: Planning) -> Check:
    topology = planning.topology
    if isinstance(topology, Failed):
        return Check(
            "numa", "fail", topology.reason, {"error": topology.reason}, (topology.reason,)
        )
    nodes = [
        {
            "id": node.id,
            "cpus": format_cpulist(node.cpus),
            "physical_cores": len(node.cores),
            "mem_total_bytes": node.mem_total,
            "mem_available_bytes": node.mem_available,
            "mem_allowed": node.mem_allowed,
        }
        for node in topology.nodes
    ]
    without_cpus = [node.id for node in topology.nodes if not node.cores]
    value = {
        "numa": topology.numa,
        "allowed_cpus": format_cpulist(topology.allowed_cpus),
        "nodes": nodes,
        "nodes_without_cpus": without_cpus,
    }
    count = len(topology.nodes)
    summary = f"{count} node{'s' * (count != 1)}"
    if without_cpus:
        summary += f", {len(without_cpus)} without usable CPUs ({format_cpulist(without_cpus)})"
    details = [
        f"node {node.id}: CPUs {format_cpulist(node.cpus) or '-'} ({len(node.cores)} cores), "
        f"{gib(node.mem_available)} available of {gib(node.mem_total)}"
        + ("" if node.mem_allowed else ", memory not allowed (cpuset.mems)")
        for node in topology.nodes
    ]
    if not topology.numa:
        details.append("the kernel exposes no NUMA nodes: one node 0 is assumed")
    if without_cpus:
        details.append(
            "a node without usable CPUs (memory-only, offline CPUs or outside the cpuset) gets "
            "no rank"
        )
    forbidden = [node.id for node in topology.nodes if not node.mem_allowed and node.cores]
    if forbidden:
        advice = (
            f"this process may not allocate on node(s) {format_cpulist(forbidden)} although it "
            f"may run on their CPUs: widen cpuset.mems (docker --cpuset-mems, systemd "
            f"AllowedMemoryNodes=) or narrow CPU_VISIBLE_MEMORY_NODES to the allowed nodes",
        )
        return Check("numa", "warn", summary, value, advice, tuple(details))
    return Check("numa", "ok", summary, value, details=tuple(details))


def _memory_limit_advice(need: int) -> str:
    return (
        f"raise the cgroup memory limit to at least {gib(need)} (systemd MemoryMax=, docker "
        f"--memory, Kubernetes resources.limits.memory), or need less: lower --kv-cache-space "
        f"(VLLM_CPU_KVCACHE_SPACE) or --max-model-len, or a smaller --dtype"
    )


def cgroup_check(inputs: DoctorInputs, planning: Planning) -> Check:
    v2, v1 = cgroup_membership(inputs.proc_root)
    cpuset = planning.cpuset
    topology = planning.topology
    limit = room = None
    if not isinstance(topology, Failed):
        limit, room = topology.cgroup_memory_limit, topology.cgroup_memory_available
    need = planning.need_bytes
    value = {
        "v2_path": v2,
        "v1_memory_path": v1.get("memory"),
        "cpuset": None
        if cpuset is None
        else {
            "version": cpuset.version,
            "path": cpuset.path,
            "cpus": format_cpulist(cpuset.cpus),
            "mems": None if cpuset.mems is None else format_cpulist(cpuset.mems),
        },
        "memory_limit_bytes": limit,
        "memory_room_bytes": room,
        "plan_needs_bytes": need,
    }
    # hybrid hosts mount some controllers as v1: those govern memory and cpuset then
    if v1.keys() & {"memory", "cpuset"} or v2 is None:
        where = f"v1 (memory {v1.get('memory', '-')}, cpuset {v1.get('cpuset', '-')})"
    else:
        where = f"v2 {v2}"
    parts = [f"cpuset {format_cpulist(cpuset.cpus)}" if cpuset else "no cpuset"]
    if limit is None:
        parts.append("no memory limit")
    else:
        parts.append(f"memory limit {gib(limit)}, {gib(room or 0)} free under it")
    if need is not None:
        parts.append(f"the plan needs {gib(need)}")
    summary = f"{where}: " + ", ".join(parts)

    advice: list[str] = []
    status = "ok"
    if limit is not None and need is not None and limit < need:
        status = "fail"
        advice.append(
            f"the cgroup memory limit {gib(limit)} is below the {gib(need)} the plan needs "
            f"(every rank's weights, KV cache and runtime plus the frontend): "
            + _memory_limit_advice(need)
        )
    elif room is not None and need is not None and room < need:
        status = "warn"
        advice.append(
            f"only {gib(room)} of the {gib(limit or 0)} limit is free (other processes in the "
            f"cgroup use the rest) and the plan needs {gib(need)}: " + _memory_limit_advice(need)
        )
    affinity = planning.affinity
    if cpuset is not None and not isinstance(affinity, Failed):
        if not affinity & frozenset(cpuset.cpus):
            status = "fail" if status == "fail" else "warn"
            advice.append(
                f"the cpuset read from {inputs.cgroup_dir} ({format_cpulist(cpuset.cpus)}) does "
                f"not overlap this process's affinity ({format_cpulist(affinity)}): the cgroup "
                f"files are not this process's (cgroup namespace?); plans use the affinity"
            )
    return Check("cgroup", status, summary, value, tuple(advice))
