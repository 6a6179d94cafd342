"""The frontend's side of the ranks: each step plan goes to every rank in lockstep and rank 0's
result comes back. Whoever owns the rank processes supplies `liveness`, called while waiting,
which raises RankDiedError once a rank is lost; a step with no result within the step timeout
raises too, so a caller never waits forever."""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from cpud.engine.rank_group import RankDiedError
from cpud.protocol.control import (
    MAX_MESSAGE_BYTES,
    RankStats,
    Shutdown,
    encoder,
    from_rank_decoder,
)
from cpud.protocol.launch import plan_socket, results_socket
from cpud.protocol.step import StepPlan, StepResult

POLL_MS = 100


class RankClient:
    def __init__(
        self,
        ctx: zmq.Context,
        runtime_dir: str,
        world_size: int,
        liveness: Callable[[], None],
        step_timeout: float = 300.0,
    ):
        self.liveness = liveness
        self.step_timeout = step_timeout
        self.stats: dict[int, RankStats] = {}
        self.results = ctx.socket(zmq.PULL)
        self.results.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.results.setsockopt(zmq.LINGER, 0)
        self.results.bind(results_socket(runtime_dir))
        self.plans: list[zmq.Socket] = []
        for rank in range(world_size):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(plan_socket(runtime_dir, rank))
            self.plans.append(sock)

    def _receive(self, timeout_ms: int) -> StepResult | None:
        """The next step result; statistics are filed on the way."""
        while self.results.poll(timeout_ms):
            message = from_rank_decoder.decode(self.results.recv())
            if isinstance(message, StepResult):
                return message
            self.stats[message.rank] = message
        return None

    def execute(self, plan: StepPlan) -> StepResult:
        payload = encoder.encode(plan)
        for sock in self.plans:
            sock.send(payload, copy=False)
        deadline = time.monotonic() + self.step_timeout
        while True:
            result = self._receive(POLL_MS)
            if result is not None and result.step_id == plan.step_id:
                return result
            self.liveness()
            if time.monotonic() > deadline:
                raise RankDiedError(
                    f"no result for step {plan.step_id} within {self.step_timeout:g} s: "
                    "a rank is hung"
                )

    def check_health(self) -> None:
        self._receive(0)
        self.liveness()

    def rank_stats(self) -> list[RankStats]:
        return [self.stats[r] for r in sorted(self.stats)]

    def shutdown(self) -> None:
        """Tell every rank to exit (they stop after the step they are in) and close."""
        for sock in self.plans:
            try:
                sock.send(encoder.encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            sock.close(linger=1000)
        self.plans = []
        self.results.close(0)
