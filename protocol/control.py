"""Frontend <-> rank messages, beside the step plans and results they share sockets with.

Frontend -> rank: StepPlan | Shutdown.  Rank -> frontend: StepResult | RankStats.
Each direction decodes into its own tagged union; nothing else is accepted.
"""

from __future__ import annotations

import msgspec

from cpud.protocol.step import StepPlan, StepResult

MAX_MESSAGE_BYTES = 256 << 20


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
FromRank = StepResult | RankStats

encoder = msgspec.msgpack.Encoder()
to_rank_decoder = msgspec.msgpack.Decoder(ToRank)
from_rank_decoder = msgspec.msgpack.Decoder(FromRank)
