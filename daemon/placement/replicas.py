"""Data-parallel replicas on one host: N replicas of --tp ranks each, placed by one binding plan.

The binding spec is planned for N x tp ranks over the usable NUMA nodes (auto: one rank per node
when there are as many nodes, split cores evenly where there are fewer, with the usual warning;
explicit: one CPU list per rank, replica by replica; nobind: nothing pinned). Replica i takes
ranks [i * tp, (i + 1) * tp) of that plan, renumbered from 0, so by default each replica holds
one group of consecutive nodes. The frontend CPUs of the whole plan are shared out: each replica
gets those on (or SMT siblings of) its own ranks' nodes, divided evenly among the replicas that
share the node; a replica left with none shares its own rank CPUs.

Memory: every replica sees the topology as it was discovered at start, each node's available
memory scaled to its share (its ranks on the node over all ranks on the node) and the cgroup
room net of the other replicas' frontends divided by N. Replicas then plan their memory alone
(cpud.placement.memory_plan), and a replica restarted later plans against the same facts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cpud.placement.binding import BindingPlan, RankPlacement, binding_spec, plan_binding
from cpud.placement.cpulist import format_cpulist
from cpud.placement.memory_plan import FRONTEND_BYTES
from cpud.placement.topology import Topology
from cpud.settings.errors import ConfigError

# Highest TCP port.
MAX_PORT = 65535


@dataclass(frozen=True)
class ReplicaPlacement:
    index: int
    # This replica's ranks (renumbered from 0) and frontend CPUs.
    binding: BindingPlan
    # The start's topology with this replica's share of memory.
    topology: Topology
    host: str
    port: int

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    @property
    def numa_nodes(self) -> tuple[int, ...]:
        return tuple(sorted({r.numa_node for r in self.binding.ranks if r.numa_node is not None}))

    def describe(self) -> str:
        nodes = ",".join(map(str, self.numa_nodes)) or "unbound"
        cpus = sorted(c for r in self.binding.ranks for c in r.cpus)
        where = f"CPUs {format_cpulist(cpus)}" if cpus else "threads not pinned"
        frontend = format_cpulist(self.binding.frontend_cpus) or "not pinned"
        return (
            f"replica {self.index}: {self.binding.tp} rank(s) on NUMA node(s) {nodes}, {where}; "
            f"frontend CPUs {frontend} ({self.binding.frontend_placement}); {self.url}"
        )


@dataclass(frozen=True)
class ReplicaPlan:
    # The plan of every rank of every replica, in replica order.
    binding: BindingPlan
    replicas: tuple[ReplicaPlacement, ...]
    # Where the router listens (None: no router); the replicas are then on loopback.
    router_host: str | None = None
    router_port: int | None = None
    # The router's Prometheus port, on loopback.
    router_metrics_port: int | None = None

    @property
    def dp(self) -> int:
        return len(self.replicas)

    def describe(self) -> list[str]:
        lines = [replica.describe() for replica in self.replicas]
        if self.router_port is not None:
            lines.append(
                f"router: {self.router_host}:{self.router_port} in front of the replicas "
                f"(its metrics on 127.0.0.1:{self.router_metrics_port})"
            )
        lines += [f"warning: {w}" for w in self.binding.all_warnings]
        lines += [f"note: {n}" for n in self.binding.notes]
        return lines


def check_dp(dp: object) -> int:
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ConfigError(f"--data-parallel-size must be a positive whole number, got {dp!r}")
    return dp


def replica_ports(host: str, port: int, dp: int, router: bool) -> tuple[str, list[int]]:
    """(host, ports) of the replicas: --host and --port + i, or loopback and --port + 1 + i
    behind the router."""
    first = port + 1 if router else port
    last = first + dp - 1 + (1 if router else 0)  # the router's metrics port too
    if last > MAX_PORT:
        raise ConfigError(
            f"--data-parallel-size {dp} needs ports {port}-{last}, past {MAX_PORT}: lower --port"
        )
    return ("127.0.0.1" if router else host), [first + i for i in range(dp)]


def plan_replicas(
    bind: str | None,
    reserved_cpus: int | None,
    tp: int,
    dp: int,
    topology: Topology,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    router: bool = False,
) -> ReplicaPlan:
    """Place `dp` replicas of `tp` ranks, or raise ConfigError saying what to change."""
    check_dp(dp)
    spec = binding_spec(bind, reserved_cpus)
    if spec.mode == "explicit" and len(spec.cpu_lists) != tp * dp:
        raise ConfigError(
            f"{spec.bind_source} gives {len(spec.cpu_lists)} CPU list(s) but "
            f"--data-parallel-size {dp} x --tp {tp} runs {tp * dp} ranks: give one list per "
            f"rank, replica by replica, separated by '|' (replica 0's ranks first)"
        )
    try:
        binding = plan_binding(spec, tp * dp, topology)
    except ConfigError as exc:
        if dp == 1:
            raise
        raise ConfigError(
            f"--data-parallel-size {dp} x --tp {tp} = {tp * dp} ranks, planned as --tp "
            f"{tp * dp} would be: {exc}"
        ) from None
    replica_host, ports = replica_ports(host, port, dp, router)
    frontends = _frontend_shares(binding, tp, dp, topology)
    replicas = []
    for index in range(dp):
        ranks = tuple(
            dataclasses.replace(rank, rank=rank.rank - index * tp)
            for rank in binding.ranks[index * tp : (index + 1) * tp]
        )
        own = _replica_binding(binding, ranks, frontends[index])
        view = replica_topology(topology, binding, ranks, dp)
        replicas.append(ReplicaPlacement(index, own, view, replica_host, ports[index]))
    if not router:
        return ReplicaPlan(binding, tuple(replicas))
    return ReplicaPlan(binding, tuple(replicas), host, port, port + dp + 1)


def _replica_binding(
    whole: BindingPlan, ranks: tuple[RankPlacement, ...], frontend: tuple[int, ...]
) -> BindingPlan:
    if whole.mode == "nobind":
        return dataclasses.replace(whole, ranks=ranks, warnings=(), notes=())
    placement = whole.frontend_placement
    if not frontend:
        frontend = tuple(sorted(c for r in ranks for c in r.cpus))
        placement = "shared"
    return BindingPlan(whole.mode, ranks, frontend, placement)


def _frontend_shares(
    binding: BindingPlan, tp: int, dp: int, topology: Topology
) -> list[tuple[int, ...]]:
    """The whole plan's frontend CPUs divided among the replicas: a node's share goes to the
    replicas with ranks on it, by whole physical cores where there are enough."""
    shares: list[list[int]] = [[] for _ in range(dp)]
    if binding.frontend_placement == "shared" or not binding.frontend_cpus:
        return [()] * dp
    by_node: dict[int | None, list[int]] = {}
    for cpu in binding.frontend_cpus:
        by_node.setdefault(topology.node_of(cpu), []).append(cpu)
    for node, cpus in by_node.items():
        owners = sorted({r.rank // tp for r in binding.ranks if r.numa_node == node})
        if not owners:
            continue
        cores: list[tuple[int, ...]] = []
        for cpu in cpus:
            core = tuple(c for c in topology.core_of(cpu) if c in cpus)
            if core not in cores:
                cores.append(core)
        units = cores if len(cores) >= len(owners) else [(c,) for c in cpus]
        for i, unit in enumerate(units):
            shares[owners[i * len(owners) // len(units)]].extend(unit)
    return [tuple(sorted(s)) for s in shares]


def replica_topology(
    topology: Topology, whole: BindingPlan, ranks: tuple[RankPlacement, ...], dp: int
) -> Topology:
    """The topology as one replica may use it: each node's available memory scaled to the
    replica's share of the ranks bound there (all nodes by 1/dp for unbound ranks), and the
    cgroup room net of the other replicas' frontends divided by dp."""
    nodes = []
    for node in topology.nodes:
        mine = sum(1 for r in ranks if r.numa_node == node.id)
        total = whole.ranks_on_node(node.id)
        if not ranks or ranks[0].numa_node is None:
            mine, total = 1, dp
        available = node.mem_available * mine // total if total else node.mem_available
        nodes.append(dataclasses.replace(node, mem_available=available))
    cgroup = topology.cgroup_memory_available
    if cgroup is not None:
        cgroup = max(0, cgroup - (dp - 1) * FRONTEND_BYTES) // dp
    return dataclasses.replace(topology, nodes=tuple(nodes), cgroup_memory_available=cgroup)
