"""`cpud serve`: the supervisor process.

It resolves the configuration and plans CPUs and memory per rank once (cpud.placement.start,
refusing with numbers a plan that cannot fit), then spawns the frontend and one process per
rank in a private 0700 runtime directory (removing those that daemons killed with SIGKILL
left), each with its spec (cpud.protocol.launch) carrying that config. The frontend gets the API
key on its stdin; no child's environment carries it. It tells systemd READY=1 only once every
rank has reported READY and the frontend serves, pings the watchdog only while every child's
heartbeat is fresh, and says STOPPING=1 on drain. Signal handlers only set state; the loop acts
on it.

Exit codes: 0 after a drain, EXIT_CONFIG (2) for a configuration the daemon refuses, and
EXIT_CHILD_LOST (3) when a rank or the frontend dies or hangs: in-flight requests have then
ended with an error, and the service manager restarts the daemon with fresh ranks (ranks are
not restarted in place: a restarted daemon needs no state and reloads weights in seconds).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import msgspec
import zmq

from cpud.engine.multiproc import make_runtime_dir
from cpud.engine.rank_group import (
    RankDiedError,
    RankGroup,
    RankTimeouts,
    kill_started,
    start_ranks,
)
from cpud.frontend.server import EXIT_CHILD_LOST, EXIT_CONFIG, frontend_spec, send_secrets
from cpud.model.model_dir import resolve_model_dir
from cpud.placement.replicas import ReplicaPlacement
from cpud.placement.start import plan_start
from cpud.process.child_process import module_command
from cpud.process.listen_address import check_listen_address
from cpud.process.sd_notify import Notifier
from cpud.protocol.launch import frontend_spec_file
from cpud.protocol.supervision import (
    FrontendServing,
    Heartbeat,
    RankDown,
    RanksReady,
    encoder,
    frontend_control_socket,
)
from cpud.settings import envs
from cpud.settings.config import EngineArgs, ServeArgs
from cpud.settings.errors import ConfigError
from cpud.text.tokenizer import Tokenizer

log = logging.getLogger("cpud.supervisor")
LOOP_S = 0.1
FRONTEND_EXIT_GRACE_S = 10.0


class Supervisor:
    """One frontend and its ranks. `replica`: where a data-parallel replica runs (its ranks,
    frontend CPUs, port and share of memory, planned by cpud.replicas for the whole host)."""

    def __init__(
        self,
        engine_args: EngineArgs,
        serve_args: ServeArgs,
        notifier: Notifier,
        replica: ReplicaPlacement | None = None,
    ):
        self.engine_args = engine_args
        self.serve_args = serve_args
        self.notifier = notifier
        self.replica = replica
        self.timeouts = RankTimeouts(
            ready=serve_args.ready_timeout,
            silent=serve_args.rank_timeout,
            step=serve_args.step_timeout,
            fresh=min(5.0, serve_args.rank_timeout),
        )
        self.stop_requested = False
        self.serving: FrontendServing | None = None
        self.frontend_beat = time.monotonic()
        self.next_watchdog = 0.0

    def _request_stop(self, signum: int, frame: object) -> None:
        self.stop_requested = True

    def _on_message(self, message: object) -> None:
        if isinstance(message, Heartbeat):
            self.frontend_beat = time.monotonic()
        elif isinstance(message, FrontendServing):
            self.serving = message

    def run(self) -> int:
        started = time.monotonic()
        check_listen_address(self.serve_args.host, self.serve_args.port)
        model_dir = resolve_model_dir(self.engine_args.model)
        runtime_dir = make_runtime_dir()
        # A stop asked for while the early ranks start or the plan is made ends the start.
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        early = self._start_ranks_early(runtime_dir)
        try:
            # Resolved and planned once: the frontend and the ranks get this config as it is.
            if self.replica is None:
                plan = plan_start(self.engine_args, model_dir)
            else:
                replica = self.replica
                plan = plan_start(self.engine_args, model_dir, replica.topology, replica.binding)
        except BaseException:
            kill_started(early)
            shutil.rmtree(runtime_dir, ignore_errors=True)
            raise
        if self.stop_requested:
            kill_started(early)
            shutil.rmtree(runtime_dir, ignore_errors=True)
            return 0
        config = plan.config
        if len(early) != config.tp:
            kill_started(early)
            early = []
        if plan.binding.frontend_cpus:
            os.sched_setaffinity(0, plan.binding.frontend_cpus)  # the frontend inherits it
        self.notifier.status(f"loading {model_dir.name} on {config.tp} rank(s)")
        ctx = zmq.Context()
        frontend: subprocess.Popen | None = None
        group: RankGroup | None = None
        try:
            # The ranks take longest to load: they start first, and the frontend's tokenizer
            # is built (checked already) while they import torch and map their weights.
            group = RankGroup(
                ctx,
                runtime_dir,
                config.spec(),
                plan.slots,
                config.collective,
                self.timeouts,
                on_message=self._on_message,
                started=early or None,
            )
            tokenizer = Tokenizer(config.model_dir, self.engine_args.chat_template).facts()
            spec = frontend_spec(runtime_dir, config, self.engine_args, self.serve_args, tokenizer)
            spec_path = Path(frontend_spec_file(runtime_dir))
            spec_path.write_bytes(msgspec.json.encode(spec))
            frontend = subprocess.Popen(
                module_command("cpud.frontend.server", str(spec_path), str(os.getpid())),
                stdin=subprocess.PIPE,
                env=envs.without_secrets(os.environ),
            )
            send_secrets(frontend.stdin, self.serve_args)
            self.frontend_beat = time.monotonic()
            to_frontend = ctx.socket(zmq.PUSH)
            to_frontend.setsockopt(zmq.LINGER, 1000)
            to_frontend.connect(frontend_control_socket(runtime_dir))
            return self._supervise(group, frontend, to_frontend, started)
        except RankDiedError as exc:
            log.error("%s", exc)
            return EXIT_CHILD_LOST
        finally:
            if frontend is not None and frontend.poll() is None:
                frontend.kill()
                frontend.wait()
            if group is not None:
                group.kill()
            else:
                kill_started(early)
            ctx.destroy(linger=0)
            shutil.rmtree(runtime_dir, ignore_errors=True)

    def _supervise(
        self,
        group: RankGroup,
        frontend: subprocess.Popen,
        to_frontend: zmq.Socket,
        started: float,
    ) -> int:
        announced = False
        ready_count = -1
        while True:
            if self.stop_requested:
                if self.serving is None:
                    log.info("stopping before the ranks were ready")
                    self.notifier.notify("STOPPING=1", "STATUS=stopping")
                    return 0  # nothing was served; `run` stops every child
                return self._drain(group, frontend, to_frontend)
            try:
                group.poll(LOOP_S)
            except RankDiedError as exc:
                return self._child_lost(group, frontend, to_frontend, exc)
            code = frontend.poll()
            if code is not None:
                return self._frontend_exited(code)
            silent = time.monotonic() - self.frontend_beat
            if silent > self.timeouts.silent:
                log.error("frontend (pid %d) sent no heartbeat for %.0f s", frontend.pid, silent)
                frontend.kill()
                return EXIT_CHILD_LOST
            if len(group.ready) != ready_count:
                ready_count = len(group.ready)
                self.notifier.status(f"loading: {ready_count}/{group.world_size} ranks ready")
                if ready_count == group.world_size:
                    to_frontend.send(encoder.encode(RanksReady(group.ready_in_rank_order())))
            if self.serving is not None and not announced:
                announced = True
                log.info(
                    "ready in %.1f s: serving %s on %s (%d rank(s))",
                    time.monotonic() - started,
                    self._model_name(),
                    self.serving.address,
                    group.world_size,
                )
                self.notifier.notify(
                    "READY=1", f"STATUS=serving on {self.serving.address}", f"MAINPID={os.getpid()}"
                )
            self._watchdog(group, silent)

    def _start_ranks_early(self, runtime_dir: str) -> list[subprocess.Popen]:
        """The ranks, started before the plan so that they import torch while the model is
        checked and the start planned; they get their specs (and load) once the plan stands,
        and are killed unread when it is refused. None for a rank count the CPUs cannot take
        (the plan refuses it)."""
        tp = self.engine_args.tp
        if not 1 <= tp <= len(os.sched_getaffinity(0)):
            return []
        return start_ranks(runtime_dir, tp)

    def _model_name(self) -> str:
        """The name clients use (the first --served-model-name, else --model)."""
        from cpud.model.default_model import DEFAULT_MODEL_NAME

        names = self.serve_args.served_model_names
        return names[0] if names else str(self.engine_args.model or DEFAULT_MODEL_NAME)

    def _watchdog(self, group: RankGroup, frontend_silent: float) -> None:
        interval = self.notifier.watchdog_seconds
        if interval is None or time.monotonic() < self.next_watchdog:
            return
        if group.heartbeats_fresh() and frontend_silent <= self.timeouts.fresh:
            self.notifier.notify("WATCHDOG=1")
            self.next_watchdog = time.monotonic() + interval / 3

    def _child_lost(
        self,
        group: RankGroup,
        frontend: subprocess.Popen,
        to_frontend: zmq.Socket,
        exc: RankDiedError,
    ) -> int:
        """The frontend fails every in-flight request and exits; then everything stops. A rank
        that found the model unusable while loading is a configuration error: no restart."""
        if group.config_failure is not None:
            raise ConfigError(group.config_failure)
        self.notifier.status(f"failed: {exc}")
        to_frontend.send(encoder.encode(RankDown(group.failed_rank or 0, str(exc))))
        try:
            frontend.wait(FRONTEND_EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            log.error("frontend did not exit after the rank was lost; killing it")
        log.error("exiting %d for a restart: %s", EXIT_CHILD_LOST, exc)
        return EXIT_CHILD_LOST

    def _frontend_exited(self, code: int) -> int:
        if code == EXIT_CONFIG:
            return EXIT_CONFIG  # it said why (e.g. the port is taken)
        log.error("frontend exited with code %d", code)
        return EXIT_CHILD_LOST

    def _drain(self, group: RankGroup, frontend: subprocess.Popen, to_frontend: zmq.Socket) -> int:
        """The frontend finishes in-flight requests (up to the drain timeout), tells the ranks
        to stop and exits; a rank lost meanwhile still fails its requests promptly."""
        # The frontend logs the drain: in-flight requests when it starts, how it ended.
        self.notifier.notify("STOPPING=1", "STATUS=draining")
        group.stopping = True
        frontend.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.serve_args.drain_timeout + FRONTEND_EXIT_GRACE_S
        lost = False
        while frontend.poll() is None and time.monotonic() < deadline:
            try:
                group.poll(LOOP_S)
            except RankDiedError as exc:
                if not lost:
                    lost = True
                    to_frontend.send(encoder.encode(RankDown(group.failed_rank or 0, str(exc))))
        code = frontend.poll()
        if code is None:
            log.error("frontend did not finish draining in time; killing it")
            return EXIT_CHILD_LOST
        group.stop()
        return 0 if code == 0 and not lost else self._frontend_exited(code or EXIT_CHILD_LOST)


def serve(engine_args: EngineArgs, serve_args: ServeArgs) -> int:
    if serve_args.data_parallel_size != 1 or serve_args.router:
        from cpud.replicas import ReplicaSupervisor

        return ReplicaSupervisor(engine_args, serve_args, Notifier()).run()
    return Supervisor(engine_args, serve_args, Notifier()).run()
