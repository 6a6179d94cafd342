"""Which CPUs and which memory node each rank gets: the binding spec and its plan.

The inputs keep vLLM's names so deployments move over unchanged:
VLLM_CPU_OMP_THREADS_BIND / --bind ("auto", "nobind" or one CPU list per rank joined by "|"),
VLLM_CPU_NUM_OF_RESERVED_CPU / --reserved-cpus and CPU_VISIBLE_MEMORY_NODES.

Rules where DESIGN.md leaves a choice:
* Reserved CPUs count per rank, as in vLLM: in auto mode a node with r ranks keeps its last
  r * reserved physical cores for the frontend and supervisor, so a one-rank-per-node plan gives
  each rank exactly vLLM's CPU list. Taking a core from every node costs no more than taking it
  from one: lockstep tensor parallelism runs at the pace of the rank with the fewest cores.
* Without --reserved-cpus, one core per rank is reserved only if every rank keeps at least
  DEFAULT_RESERVE_MIN_CORES cores; on smaller machines a dedicated frontend core would cost the
  ranks more than the frontend's occasional work on their cores.
* Physical cores a node cannot split evenly among its ranks go to the frontend too (an extra
  core would only make one rank wait for the others sooner).
* The frontend runs on idle cores of the nodes that hold ranks (never on other nodes, which may
  belong to another instance), else on idle SMT siblings of rank cores, else it shares the rank
  CPUs; the plan says which.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from cpud.placement.cpulist import format_cpulist, parse_cpulist, parse_id_sequence
from cpud.placement.topology import NumaNode, Topology
from cpud.settings import setting
from cpud.settings.errors import ConfigError

# vLLM's variables, as the settings table names them (each setting names exactly one).
(BIND_ENV,) = setting("bind").env_aliases
(RESERVED_ENV,) = setting("reserved_cpus").env_aliases
VISIBLE_NODES_ENV = "CPU_VISIBLE_MEMORY_NODES"

DEFAULT_RESERVE_MIN_CORES = 8

BindMode = Literal["auto", "nobind", "explicit"]
FrontendPlacement = Literal["reserved", "smt-siblings", "shared", "unbound"]


@dataclass(frozen=True)
class BindingSpec:
    mode: BindMode = "auto"
    # explicit mode: one sorted CPU list per rank
    cpu_lists: tuple[tuple[int, ...], ...] = ()
    # CPUs per rank kept for the frontend; None: the default rule above
    reserved: int | None = None
    # CPU_VISIBLE_MEMORY_NODES in its order; None: every node
    visible_nodes: tuple[int, ...] | None = None
    # where the values came from, for error messages
    bind_source: str = "--bind"
    reserved_source: str = "--reserved-cpus"


@dataclass(frozen=True)
class RankPlacement:
    rank: int
    # One OpenMP thread per entry, pinned in this order; () means not pinned.
    cpus: tuple[int, ...]
    # The node its memory is bound to; None means not bound.
    numa_node: int | None
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class BindingPlan:
    mode: BindMode
    ranks: tuple[RankPlacement, ...]
    # CPUs for the frontend and supervisor; () means not pinned.
    frontend_cpus: tuple[int, ...]
    frontend_placement: FrontendPlacement
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def tp(self) -> int:
        return len(self.ranks)

    @property
    def frontend_shares(self) -> bool:
        """True when the frontend has no core of its own."""
        return self.frontend_placement in ("smt-siblings", "shared")

    @property
    def all_warnings(self) -> tuple[str, ...]:
        return self.warnings + tuple(w for rank in self.ranks for w in rank.warnings)

    def ranks_on_node(self, node_id: int) -> int:
        return sum(1 for rank in self.ranks if rank.numa_node == node_id)

    def describe(self) -> list[str]:
        """Log lines: one per rank, the frontend, then warnings and notes."""
        lines = []
        for rank in self.ranks:
            where = "unbound" if rank.numa_node is None else f"NUMA node {rank.numa_node}"
            count = len(rank.cpus)
            threads = (
                f"{count} thread{'s' * (count != 1)} on CPUs {format_cpulist(rank.cpus)}"
                if rank.cpus
                else "threads not pinned"
            )
            lines.append(f"rank {rank.rank}: {where}, {threads}")
        frontend = format_cpulist(self.frontend_cpus) or "not pinned"
        lines.append(f"frontend: CPUs {frontend} ({self.frontend_placement})")
        lines += [f"warning: {w}" for w in self.all_warnings]
        lines += [f"note: {n}" for n in self.notes]
        return lines


# --- the spec ------------------------------------------------------------------------------


def parse_bind(text: str, source: str = "--bind") -> tuple[BindMode, tuple[tuple[int, ...], ...]]:
    """'auto' | 'nobind' | 'CPUS|CPUS|...' -> (mode, per-rank CPU lists)."""
    value = text.strip()
    if value.lower() in ("", "auto"):
        return "auto", ()
    if value.lower() == "nobind":
        return "nobind", ()
    lists = []
    for rank, part in enumerate(value.split("|")):
        what = f"{source}={value!r}: rank {rank}'s CPU list"
        cpus = parse_cpulist(part, what)
        if not cpus:
            raise ConfigError(
                f"{what} is empty: give one non-empty CPU list per rank, e.g. '0-31|32-63'"
            )
        lists.append(cpus)
    return "explicit", tuple(lists)


def parse_reserved(value: int | str, source: str = "--reserved-cpus") -> int:
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdigit():
        raise ConfigError(f"{source}={value!r}: expected a whole number of CPUs >= 0")
    return int(text)


def binding_spec(
    bind: str | None = None,
    reserved: int | str | None = None,
    visible_nodes: str | None = None,
    env: Mapping[str, str] | None = None,
) -> BindingSpec:
    """The spec from CLI values, falling back to the vLLM environment variables."""
    env = os.environ if env is None else env
    bind_source, reserved_source = "--bind", "--reserved-cpus"
    if bind is None and env.get(BIND_ENV, "").strip():
        bind, bind_source = env[BIND_ENV], BIND_ENV
    if reserved is None and env.get(RESERVED_ENV, "").strip():
        reserved, reserved_source = env[RESERVED_ENV], RESERVED_ENV
    if visible_nodes is None:
        visible_nodes = env.get(VISIBLE_NODES_ENV, "")
    mode, lists = parse_bind(bind or "auto", bind_source)
    nodes = parse_id_sequence(visible_nodes, f"{VISIBLE_NODES_ENV}={visible_nodes!r}")
    return BindingSpec(
        mode=mode,
        cpu_lists=lists,
        reserved=None if reserved is None else parse_reserved(reserved, reserved_source),
        visible_nodes=nodes or None,
        bind_source=bind_source,
        reserved_source=reserved_source,
    )


# --- the plan ------------------------------------------------------------------------------


def plan_binding(spec: BindingSpec, tp: int, topology: Topology) -> BindingPlan:
    """Place `tp` ranks on the topology, or raise ConfigError saying what to change."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"--tp must be a positive whole number, got {tp!r}")
    if spec.mode == "nobind":
        return _plan_nobind(spec, tp)
    visible, notes = _visible_nodes(spec, topology)
    if spec.mode == "explicit":
        return _plan_explicit(spec, tp, topology, visible, notes)
    return _plan_auto(spec, tp, topology, visible, notes)


def _plan_nobind(spec: BindingSpec, tp: int) -> BindingPlan:
    notes = [
        "nobind: no CPU affinity and no memory binding; the OS places threads and pages "
        "(OMP_NUM_THREADS sets the thread count)"
    ]
    if spec.reserved is not None or spec.visible_nodes is not None:
        notes.append(f"nobind ignores {spec.reserved_source} and {VISIBLE_NODES_ENV}")
    ranks = tuple(RankPlacement(rank, (), None) for rank in range(tp))
    return BindingPlan("nobind", ranks, (), "unbound", (), tuple(notes))


def _visible_nodes(spec: BindingSpec, topology: Topology) -> tuple[list[int], list[str]]:
    """Node ids ranks may bind memory to, in rank order, and notes about dropped ones."""
    existing = topology.node_ids
    notes: list[str] = []
    if spec.visible_nodes is None:
        wanted = list(existing)
    else:
        wanted = list(spec.visible_nodes)
        missing = [n for n in wanted if n not in existing]
        if missing:
            raise ConfigError(
                f"{VISIBLE_NODES_ENV}={','.join(map(str, wanted))} names NUMA node(s) "
                f"{format_cpulist(missing)}, but this machine has node(s) "
                f"{format_cpulist(existing)}: list only existing nodes"
            )
    forbidden = [n for n in wanted if not topology.node(n).mem_allowed]
    if forbidden:
        notes.append(
            f"NUMA node(s) {format_cpulist(forbidden)} are outside this process's allowed "
            f"memory nodes (cpuset.mems): no rank binds memory there"
        )
    return [n for n in wanted if n not in forbidden], notes


def _ranks_per_node(tp: int, nodes: int) -> list[int]:
    base, extra = divmod(tp, nodes)
    return [base + 1 if i < extra else base for i in range(nodes)]


def _fits(nodes: list[NumaNode], counts: list[int]) -> bool:
    return all(len(node.cores) >= count for node, count in zip(nodes, counts))


def _cores_kept(nodes: list[NumaNode], counts: list[int], reserved: int) -> int:
    """Cores each rank keeps on the tightest node when `reserved` are taken per rank."""
    return min(
        (len(node.cores) - reserved * count) // count for node, count in zip(nodes, counts) if count
    )


def _plan_auto(
    spec: BindingSpec, tp: int, topology: Topology, visible: list[int], notes: list[str]
) -> BindingPlan:
    warnings: list[str] = []
    nodes: list[NumaNode] = []
    for node_id in visible:
        node = topology.node(node_id)
        if node.cores:
            nodes.append(node)
        else:
            notes.append(
                f"NUMA node {node_id} has no CPU this process may use (memory-only, offline or "
                f"outside the cpuset): no rank on it"
            )
    if not nodes:
        raise ConfigError(
            f"no usable NUMA node has CPUs this process may use (nodes considered: "
            f"{','.join(map(str, visible)) or 'none'}; allowed CPUs: "
            f"{format_cpulist(topology.allowed_cpus)}): check {VISIBLE_NODES_ENV} and the cpuset"
        )
    if tp < len(nodes):
        used = ",".join(str(n.id) for n in nodes[:tp])
        notes.append(
            f"--tp {tp} uses NUMA node(s) {used} of the {len(nodes)} usable nodes "
            f"({','.join(str(n.id) for n in nodes)}); --tp {len(nodes)} would use them all"
        )
        nodes = nodes[:tp]
    counts = _ranks_per_node(tp, len(nodes))
    if not _fits(nodes, counts):
        largest = max(t for t in range(1, tp) if _fits(nodes, _ranks_per_node(t, len(nodes))))
        raise ConfigError(
            f"--tp {tp} needs one physical core per rank, but "
            + ", ".join(
                f"node {n.id} has {len(n.cores)} usable core(s) for {c} rank(s)"
                for n, c in zip(nodes, counts)
                if len(n.cores) < c
            )
            + f": lower --tp to {largest} or use --bind nobind"
        )

    reserved = _reserved_per_rank(spec, nodes, counts, warnings, notes)
    ranks: list[RankPlacement] = []
    for node, count in zip(nodes, counts):
        per_rank = (len(node.cores) - reserved * count) // count
        first_rank = len(ranks)
        for i in range(count):
            cores = node.cores[i * per_rank : (i + 1) * per_rank]
            ranks.append(RankPlacement(len(ranks), tuple(core[0] for core in cores), node.id))
        if count > 1:
            warnings.append(
                f"ranks {first_rank}-{len(ranks) - 1} share NUMA node {node.id}: each gets "
                f"{per_rank} of its {len(node.cores)} cores and a share of its memory bandwidth "
                f"and capacity"
            )
    return _finish("auto", ranks, topology, warnings, notes)


def _reserved_per_rank(
    spec: BindingSpec,
    nodes: list[NumaNode],
    counts: list[int],
    warnings: list[str],
    notes: list[str],
) -> int:
    if spec.reserved is None:
        if _cores_kept(nodes, counts, 1) >= DEFAULT_RESERVE_MIN_CORES:
            return 1
        notes.append(
            f"no core reserved for the frontend by default: ranks would keep fewer than "
            f"{DEFAULT_RESERVE_MIN_CORES} cores each; --reserved-cpus 1 reserves one per rank"
        )
        return 0
    reserved = spec.reserved
    while reserved and _cores_kept(nodes, counts, reserved) < 1:
        reserved -= 1
    if reserved < spec.reserved:
        warnings.append(
            f"{spec.reserved_source}={spec.reserved} would leave a rank without a core: "
            f"reserving {reserved} CPU(s) per rank instead"
        )
    return reserved


def _majority_node(
    cpus: tuple[int, ...], topology: Topology, visible: list[int]
) -> tuple[int | None, Counter[int]]:
    """The visible node holding most of `cpus` (ties: earlier in visible order)."""
    per_node: Counter[int] = Counter()
    for cpu in cpus:
        node = topology.node_of(cpu)
        if node is not None:
            per_node[node] += 1
    candidates = [(per_node[n], -i, n) for i, n in enumerate(visible) if per_node[n]]
    return (max(candidates)[2] if candidates else None), per_node


def _plan_explicit(
    spec: BindingSpec, tp: int, topology: Topology, visible: list[int], notes: list[str]
) -> BindingPlan:
    src = spec.bind_source
    lists = spec.cpu_lists
    if len(lists) != tp:
        raise ConfigError(
            f"{src} gives {len(lists)} CPU list(s) but --tp is {tp}: give exactly one list per "
            f"rank, separated by '|' (e.g. '0-31|32-63' for --tp 2)"
        )
    for rank, cpus in enumerate(lists):
        offline = [c for c in cpus if c not in topology.online_cpus]
        if offline:
            raise ConfigError(
                f"{src}: rank {rank}'s list has CPU(s) {format_cpulist(offline)}, which are "
                f"offline or absent (online: {format_cpulist(topology.online_cpus)}): "
                f"use online CPUs only"
            )
        outside = [c for c in cpus if c not in topology.allowed_cpus]
        if outside:
            raise ConfigError(
                f"{src}: rank {rank}'s list has CPU(s) {format_cpulist(outside)}, outside the "
                f"CPUs this process may use ({format_cpulist(topology.allowed_cpus)}, from its "
                f"affinity/cpuset): keep every list inside them"
            )
        for earlier in range(rank):
            shared = set(cpus) & set(lists[earlier])
            if shared:
                raise ConfigError(
                    f"{src}: CPU(s) {format_cpulist(shared)} appear in the lists of rank "
                    f"{earlier} and rank {rank}: each CPU may belong to one rank only"
                )
    if spec.reserved is not None:
        notes.append(
            f"{spec.reserved_source} is not used with explicit lists: the frontend gets the "
            f"allowed CPUs outside them"
        )

    warnings: list[str] = []
    ranks: list[RankPlacement] = []
    for rank, cpus in enumerate(lists):
        node, per_node = _majority_node(cpus, topology, visible)
        if node is None:
            raise ConfigError(
                f"{src}: rank {rank}'s CPUs {format_cpulist(cpus)} are on NUMA node(s) "
                f"{format_cpulist(per_node)}, none of which may hold its memory (usable nodes: "
                f"{','.join(map(str, visible)) or 'none'}): check {VISIBLE_NODES_ENV} and "
                f"cpuset.mems"
            )
        rank_warnings = []
        if len(per_node) > 1:
            spread = ", ".join(f"{n} on node {i}" for i, n in sorted(per_node.items()))
            rank_warnings.append(
                f"rank {rank}'s CPUs span NUMA nodes ({spread}): its memory is bound to node "
                f"{node}, so threads elsewhere read remote memory"
            )
        doubled = [c for c in cpus if len(set(topology.core_of(c)) & set(cpus)) > 1]
        if doubled:
            rank_warnings.append(
                f"rank {rank} has SMT siblings {format_cpulist(doubled)} in its list: two "
                f"threads share each of those physical cores"
            )
        ranks.append(RankPlacement(rank, cpus, node, tuple(rank_warnings)))
    for node_id in sorted({r.numa_node for r in ranks if r.numa_node is not None}):
        sharing = [r.rank for r in ranks if r.numa_node == node_id]
        if len(sharing) > 1:
            warnings.append(
                f"ranks {','.join(map(str, sharing))} share NUMA node {node_id}: they split "
                f"its memory bandwidth and capacity"
            )
    return _finish("explicit", ranks, topology, warnings, notes)


def _finish(
    mode: BindMode,
    ranks: list[RankPlacement],
    topology: Topology,
    warnings: list[str],
    notes: list[str],
) -> BindingPlan:
    sizes = [len(r.cpus) for r in ranks]
    if len(set(sizes)) > 1:
        warnings.append(
            f"ranks have unequal thread counts ({', '.join(map(str, sizes))}): each "
            f"tensor-parallel step runs at the pace of the rank with the fewest"
        )
    frontend, placement = _frontend(ranks, topology)
    cpus = format_cpulist(frontend)
    if placement == "reserved":
        notes.append(f"frontend and supervisor run on CPUs {cpus}, which no rank uses")
    elif placement == "smt-siblings":
        notes.append(
            f"no spare core: frontend and supervisor run on CPUs {cpus}, SMT siblings of rank cores"
        )
    else:
        warnings.append(
            f"no spare CPU: frontend and supervisor share the rank CPUs {cpus} (the machine is "
            f"too small to reserve a core)"
        )
    return BindingPlan(mode, tuple(ranks), frontend, placement, tuple(warnings), tuple(notes))


def _frontend(
    ranks: list[RankPlacement], topology: Topology
) -> tuple[tuple[int, ...], FrontendPlacement]:
    """CPUs for the frontend on the nodes that hold ranks, and how they relate to rank CPUs."""
    rank_cpus = {cpu for rank in ranks for cpu in rank.cpus}
    node_ids = {r.numa_node for r in ranks} | {topology.node_of(c) for c in rank_cpus}
    cores = [core for node in topology.nodes if node.id in node_ids for core in node.cores]
    idle = [cpu for core in cores if not rank_cpus & set(core) for cpu in core]
    if idle:
        return tuple(sorted(idle)), "reserved"
    siblings = [cpu for core in cores for cpu in core if cpu not in rank_cpus]
    if siblings:
        return tuple(sorted(siblings)), "smt-siblings"
    return tuple(sorted(rank_cpus)), "shared"
