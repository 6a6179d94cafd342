"""The frontend's end of the supervisor channel: RanksReady and RankDown come in; heartbeats
and FrontendServing go out."""

from __future__ import annotations

import os

import zmq

from cpud.engine.rank_group import RankDiedError
from cpud.protocol.supervision import (
    MAX_MESSAGE_BYTES,
    FrontendServing,
    Heartbeat,
    RankDown,
    RanksReady,
    encoder,
    frontend_control_socket,
    supervisor_socket,
    to_frontend_decoder,
)


class SupervisorLink:
    def __init__(self, ctx: zmq.Context, runtime_dir: str):
        self.inbox = ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.bind(frontend_control_socket(runtime_dir))
        self.outbox = ctx.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.LINGER, 1000)
        self.outbox.setsockopt(zmq.SNDHWM, 16)
        self.outbox.connect(supervisor_socket(runtime_dir))
        self.ranks: RanksReady | None = None
        self.down: RankDown | None = None

    def _read(self) -> None:
        while self.inbox.poll(0):
            message = to_frontend_decoder.decode(self.inbox.recv())
            if isinstance(message, RanksReady):
                self.ranks = message
            elif self.down is None:
                self.down = message

    def ranks_ready(self) -> RanksReady | None:
        self._read()
        return self.ranks

    def liveness(self) -> None:
        """Raise RankDiedError once the supervisor has reported a rank lost (RankClient calls
        this from the engine thread, which alone reads the inbox after the ranks are ready)."""
        self._read()
        if self.down is not None:
            raise RankDiedError(self.down.reason)

    def _send(self, message: object) -> None:
        try:
            self.outbox.send(encoder.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the supervisor is gone or slow; it notices missing heartbeats itself

    def heartbeat(self) -> None:
        self._send(Heartbeat("frontend", 0, os.getpid()))

    def serving(self, address: str) -> None:
        self._send(FrontendServing(os.getpid(), address))

    def close(self) -> None:
        self.inbox.close(0)
        self.outbox.close()
