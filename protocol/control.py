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


ToRank = StepPlan | Shutdown
FromRank = Ready | RankFailed | StepResult

encoder = msgspec.msgpack.Encoder()
to_rank_decoder = msgspec.msgpack.Decoder(ToRank)
from_rank_decoder = msgspec.msgpack.Decoder(FromRank)
