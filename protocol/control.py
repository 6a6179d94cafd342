"""Rank <-> frontend control messages, sharing the wire with step plans and results.

Frontend -> rank: StepPlan | Shutdown.  Rank -> frontend: Ready | RankFailed | StepResult.
Each direction decodes into its own tagged union; nothing else is accepted.
"""

from __future__ import annotations

import msgspec

from cpud.protocol.step import StepPlan, StepResult

MAX_MESSAGE_BYTES = 256 << 20


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    rank: int
    pid: int
    numa_node: int | None
    cpus: list[int]
    thread_cpus: list[int]  # sched_getcpu() of each OpenMP thread after pinning
    load_seconds: float
    kernels: str
    warnings: list[str] = []


class RankFailed(msgspec.Struct, frozen=True, tag="failed"):
    rank: int
    message: str


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown"):
    pass


class RankStats(msgspec.Struct, frozen=True, tag="stats"):
    """Cumulative counters of one rank, sent about once a second while it works."""

    rank: int
    numa_node: int | None
    steps: int
    step_seconds: float
    allreduce_seconds: float
    allreduce_calls: int
    threads: int  # OpenMP threads the rank runs
    threads_bound: int  # of those, pinned to their own CPU as planned
    threads_busy: int  # threads that used CPU time since the previous report
    resident_bytes: int
    kv_bytes: int


ToRank = StepPlan | Shutdown
FromRank = Ready | RankFailed | StepResult | RankStats

encoder = msgspec.msgpack.Encoder()
to_rank_decoder = msgspec.msgpack.Decoder(ToRank)
from_rank_decoder = msgspec.msgpack.Decoder(FromRank)
