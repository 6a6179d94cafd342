"""How --data-parallel-size splits the host: each replica's ranks, NUMA nodes, frontend CPUs,
port and memory plan (the binding and memory items above show replica 0's)."""

from __future__ import annotations

from cpud.doctor.planning import Failed, Planning
from cpud.doctor.report import Check, gib


def replicas_check(planning: Planning) -> Check:
    plan = planning.replicas
    if plan is None:
        return Check(
            "replicas",
            "ok",
            "one replica (--data-parallel-size 1)",
            {"data_parallel_size": 1},
        )
    if isinstance(plan, Failed):
        status = "warn" if plan.upstream else "fail"
        return Check(
            "replicas",
            status,
            "cannot be planned",
            {"error": plan.reason},
            (plan.reason,),
        )
    rows, details, advice = [], [], []
    failed = False
    for replica, memory in zip(plan.replicas, planning.replica_memory):
        row: dict[str, object] = {
            "replica": replica.index,
            "numa_nodes": list(replica.numa_nodes),
            "rank_cpus": [list(r.cpus) for r in replica.binding.ranks],
            "frontend_cpus": list(replica.binding.frontend_cpus),
            "url": replica.url,
        }
        details.append(replica.describe())
        if isinstance(memory, Failed):
            failed = failed or not memory.upstream
            row["memory_error"] = memory.reason
            details.append(f"  memory: {memory.reason}")
            if not memory.upstream:
                advice.append(f"replica {replica.index}: {memory.reason}")
        else:
            tight = min(memory.ranks, key=lambda r: r.budget_bytes - r.total_bytes)
            row |= {"num_kv_blocks": memory.num_kv_blocks, "kv_tokens": memory.kv_tokens}
            details.append(
                f"  memory per rank: {gib(tight.total_bytes)} of {gib(tight.budget_bytes)} "
                f"(KV cache {memory.kv_tokens} tokens; the replica's share: {tight.budget_source})"
            )
        rows.append(row)
    details += [f"warning: {w}" for w in plan.binding.all_warnings]
    value = {"data_parallel_size": plan.dp, "replicas": rows}
    tp = plan.replicas[0].binding.tp
    summary = f"{plan.dp} replicas x {tp} rank(s): " + "; ".join(
        f"{r.index} on node(s) {','.join(map(str, r.numa_nodes)) or 'unbound'}"
        for r in plan.replicas
    )
    if failed:
        return Check(
            "replicas", "fail", "a replica does not fit", value, tuple(advice), tuple(details)
        )
    status = "warn" if plan.binding.all_warnings else "ok"
    return Check("replicas", status, summary, value, (), tuple(details))
