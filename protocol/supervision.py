"""Messages between the supervisor and its children (ranks and the frontend).

Children -> supervisor: Ready | RankFailed | Heartbeat | FrontendServing.
Supervisor -> frontend: RanksReady | RankDown.
"""

from __future__ import annotations

from typing import Literal

import msgspec

MAX_MESSAGE_BYTES = 1 << 20
HEARTBEAT_INTERVAL_S = 1.0


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    """A rank is bound, pinned and loaded, with the facts it resolved."""

    rank: int
    pid: int
    numa_node: int | None
    cpus: list[int]
    thread_cpus: list[int]  # sched_getcpu() of each OpenMP thread after pinning
    load_seconds: float
    kernels: str
    num_kv_blocks: int
    warnings: list[str] = []


class RankFailed(msgspec.Struct, frozen=True, tag="failed"):
    rank: int
    message: str
    config_error: bool = False  # the model or the settings are unusable: restarting won't help


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat"):
    """Sent every HEARTBEAT_INTERVAL_S by a thread of each child, loading or serving."""

    role: Literal["rank", "frontend"]
    index: int  # the rank; 0 for the frontend
    pid: int
    busy_seconds: float = 0.0  # how long the current step has run; 0 when idle


class FrontendServing(msgspec.Struct, frozen=True, tag="serving"):
    """The frontend attached the ranks and accepts requests."""

    pid: int
    address: str


class RanksReady(msgspec.Struct, frozen=True, tag="ranks_ready"):
    ranks: list[Ready]


class RankDown(msgspec.Struct, frozen=True, tag="rank_down"):
    rank: int
    reason: str


ToSupervisor = Ready | RankFailed | Heartbeat | FrontendServing
ToFrontend = RanksReady | RankDown

encoder = msgspec.msgpack.Encoder()
to_supervisor_decoder = msgspec.msgpack.Decoder(ToSupervisor)
to_frontend_decoder = msgspec.msgpack.Decoder(ToFrontend)


def supervisor_socket(runtime_dir: str) -> str:
    return f"ipc://{runtime_dir}/supervisor"


def frontend_control_socket(runtime_dir: str) -> str:
    return f"ipc://{runtime_dir}/frontend.control"
