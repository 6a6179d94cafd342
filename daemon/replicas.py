"""`cpud serve --data-parallel-size N [--router]`: N replicas on one host, each the usual
supervisor (cpud.supervisor) with its own frontend, ranks and port, and optionally vLLM's router
in front of them.

The host is planned once, here (cpud.placement.replicas): every replica's ranks, frontend CPUs,
port and share of memory; each replica's start (memory included) is checked before any process
is spawned, so a plan that cannot fit is refused with numbers as a single replica's is. Each
replica then runs as a child process (cpud.replicas_child) whose sd_notify messages come to a
socket of ours: READY=1 says it serves, WATCHDOG=1 that it is alive.

A replica that exits 3 (a rank or its frontend lost: its in-flight requests have failed fast)
is started again after a backoff while the others keep serving; one that exits 2 refused its
configuration and stops everything. The router, when asked for, starts once every replica
serves and is restarted the same way when it exits. systemd hears READY=1 once every replica
(and the router) serves, WATCHDOG=1 only while no replica has gone silent, and STOPPING=1 on
SIGTERM: the replicas drain (their /health turns 503, so the router stops sending), then the
router stops. Nothing outlives this process: each child dies with its parent.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from cpud.engine.multiproc import make_runtime_dir
from cpud.frontend.server import EXIT_CHILD_LOST, EXIT_CONFIG, send_secrets
from cpud.model.default_model import DEFAULT_MODEL_NAME
from cpud.model.model_dir import resolve_model_dir
from cpud.placement.replicas import ReplicaPlacement, ReplicaPlan, check_dp, plan_replicas
from cpud.placement.start import plan_start
from cpud.placement.topology import discover_topology
from cpud.process.child_process import module_command
from cpud.process.listen_address import check_listen_address
from cpud.process.parent_death import die_with_parent
from cpud.process.sd_notify import Notifier
from cpud.replicas_router import (
    check_router_installed,
    extra_args,
    kv_event_args,
    router_command,
)
from cpud.replicas_spec import replica_spec, write_spec
from cpud.settings import envs
from cpud.settings.config import EngineArgs, ServeArgs

log = logging.getLogger("cpud.replicas")
LOOP_S = 0.1
# Restart backoff: doubled after each start that never became ready, up to the maximum.
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
# Starts in a row that never became ready before the whole daemon gives up (exit 3).
MAX_FAILED_STARTS = 5
STOP_GRACE_S = 10.0


@dataclass
class Child:
    """One supervised child process (a replica or the router) and its restart state."""

    name: str
    proc: subprocess.Popen | None = None
    ready: bool = False
    failed_starts: int = 0
    backoff: float = FIRST_BACKOFF_S
    start_at: float = 0.0  # when a stopped child may start again
    last_alive: float = field(default_factory=time.monotonic)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def schedule_restart(self) -> None:
        self.proc = None
        self.ready = False
        self.failed_starts += 1
        self.start_at = time.monotonic() + self.backoff
        self.backoff = min(self.backoff * 2, MAX_BACKOFF_S)

    def mark_ready(self) -> None:
        self.ready = True
        self.failed_starts = 0
        self.backoff = FIRST_BACKOFF_S


class ReplicaSupervisor:
    def __init__(self, engine_args: EngineArgs, serve_args: ServeArgs, notifier: Notifier):
        self.engine_args = engine_args
        self.serve_args = serve_args
        self.notifier = notifier
        self.stop_requested = False
        self.announced = False
        self.next_watchdog = 0.0

    def _request_stop(self, signum: int, frame: object) -> None:
        self.stop_requested = True

    # --- planning ------------------------------------------------------------------------------

    def plan(self) -> ReplicaPlan:
        """The host's plan with every replica's start checked; ConfigError where it cannot run."""
        serve = self.serve_args
        dp = check_dp(serve.data_parallel_size)
        if serve.router:
            check_router_installed()
            extra_args(serve.router_args)
        model_dir = resolve_model_dir(self.engine_args.model)
        topology = discover_topology()
        plan = plan_replicas(
            self.engine_args.bind,
            self.engine_args.reserved_cpus,
            self.engine_args.tp,
            dp,
            topology,
            host=serve.host,
            port=serve.port,
            router=serve.router,
        )
        if plan.router_port is not None:
            check_listen_address(serve.host, plan.router_port)
        for replica in plan.replicas:
            check_listen_address(replica.host, replica.port)
        for line in plan.describe():
            log.info("replicas: %s", line)
        for replica in plan.replicas:
            start = plan_start(self.engine_args, model_dir, replica.topology, replica.binding)
            for line in start.memory.describe():
                log.info("replica %d memory: %s", replica.index, line)
        return plan

    # --- the loop ------------------------------------------------------------------------------

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        plan = self.plan()
        if self.stop_requested:
            return 0
        workdir = Path(make_runtime_dir())
        replicas = [Child(f"replica {r.index}") for r in plan.replicas]
        sockets = [self._notify_socket(workdir, r.index) for r in plan.replicas]
        router = Child("router") if plan.router_port is not None else None
        for replica in plan.replicas:
            spec = replica_spec(self.engine_args, self.serve_args, replica)
            write_spec(workdir / f"replica{replica.index}.json", spec)
        self.notifier.status(f"starting {plan.dp} replica(s)")
        try:
            return self._supervise(plan, workdir, replicas, sockets, router)
        finally:
            self._kill_all(replicas, router)
            for sock in sockets:
                sock.close()
            shutil.rmtree(workdir, ignore_errors=True)

    def _supervise(
        self,
        plan: ReplicaPlan,
        workdir: Path,
        replicas: list[Child],
        sockets: list[socket.socket],
        router: Child | None,
    ) -> int:
        while True:
            if self.stop_requested:
                return self._drain(replicas, router)
            now = time.monotonic()
            for replica, child in zip(plan.replicas, replicas):
                if child.proc is None and now >= child.start_at:
                    self._start_replica(workdir, replica, child, sockets[replica.index])
            self._read_notifications(replicas, sockets)
            for child in replicas:
                code = self._check_exit(child)
                if code is not None:
                    return code
            if router is not None:
                code = self._check_router(plan, router, replicas)
                if code is not None:
                    return code
            if not self.announced and all(c.ready for c in replicas):
                if router is None or router.ready:
                    self._announce(plan)
            self._watchdog(replicas)

    def _start_replica(
        self, workdir: Path, replica: ReplicaPlacement, child: Child, sock: socket.socket
    ) -> None:
        env = envs.without_secrets(os.environ)
        env["NOTIFY_SOCKET"] = sock.getsockname()
        env.pop("WATCHDOG_PID", None)
        env.pop("WATCHDOG_USEC", None)
        if self.notifier.watchdog_seconds is not None:
            env["WATCHDOG_USEC"] = str(int(self.notifier.watchdog_seconds * 1e6))
        spec = workdir / f"replica{replica.index}.json"
        child.proc = subprocess.Popen(
            module_command("cpud.replicas_child", str(spec), str(os.getpid())),
            stdin=subprocess.PIPE,
            env=env,
        )
        send_secrets(child.proc.stdin, self.serve_args)
        child.last_alive = time.monotonic()
        log.info("%s: started (pid %d) on %s", child.name, child.proc.pid, replica.url)

    def _notify_socket(self, workdir: Path, index: int) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        sock.bind(str(workdir / f"replica{index}.notify"))
        sock.setblocking(False)
        return sock

    def _read_notifications(self, replicas: list[Child], sockets: list[socket.socket]) -> None:
        readable, _, _ = select.select(sockets, [], [], LOOP_S)
        for sock in readable:
            child = replicas[sockets.index(sock)]
            while True:
                try:
                    payload = sock.recv(4096)
                except BlockingIOError:
                    break
                if not child.running:
                    continue  # from a replica that is gone
                child.last_alive = time.monotonic()
                fields = payload.decode(errors="replace").splitlines()
                if "READY=1" in fields and not child.ready:
                    child.mark_ready()
                    log.info("%s: serving", child.name)
                    self._status(replicas)

    def _check_exit(self, child: Child) -> int | None:
        """None while the child runs or was restarted; an exit code for the whole daemon."""
        code = child.exited()
        if code is None:
            return None
        if code == EXIT_CONFIG:
            log.error("%s refused its configuration: stopping every replica", child.name)
            return EXIT_CONFIG
        child.schedule_restart()
        if child.failed_starts > MAX_FAILED_STARTS:
            log.error("%s failed %d starts in a row: exiting", child.name, MAX_FAILED_STARTS)
            return EXIT_CHILD_LOST
        log.error(
            "%s exited with code %d: its requests failed; restarting it in %.0f s",
            child.name,
            code,
            child.start_at - time.monotonic(),
        )
        self.notifier.status(f"{child.name} lost: restarting it")
        return None

    def _check_router(self, plan: ReplicaPlan, router: Child, replicas: list[Child]) -> int | None:
        if router.proc is None:
            serving = self.announced or all(c.ready for c in replicas)
            if time.monotonic() >= router.start_at and serving:
                env = envs.without_secrets(os.environ)
                env.pop("NOTIFY_SOCKET", None)
                command = router_command(plan, self.serve_args.router_args, self._kv_sources(plan))
                parent = os.getpid()
                router.proc = subprocess.Popen(
                    command, env=env, preexec_fn=lambda: die_with_parent(parent)
                )
                log.info("router: started (pid %d) on port %d", router.proc.pid, plan.router_port)
            return None
        if not router.ready and router.running and _healthy(plan):
            router.mark_ready()
            log.info("router: serving on %s:%d", plan.router_host, plan.router_port)
        return self._check_exit(router)

    def _kv_sources(self, plan: ReplicaPlan) -> list[str]:
        names = self.serve_args.served_model_names
        model = names[0] if names else str(self.engine_args.model or DEFAULT_MODEL_NAME)
        kv_events = self.serve_args.kv_events
        return kv_event_args(plan, kv_events, model, self.engine_args.block_size)

    def _announce(self, plan: ReplicaPlan) -> None:
        self.announced = True
        where = (
            f"{plan.router_host}:{plan.router_port} (router)"
            if plan.router_port is not None
            else ", ".join(r.url for r in plan.replicas)
        )
        log.info("ready: %d replica(s) serving on %s", plan.dp, where)
        self.notifier.notify("READY=1", f"STATUS=serving on {where}", f"MAINPID={os.getpid()}")

    def _status(self, replicas: list[Child]) -> None:
        ready = sum(c.ready for c in replicas)
        self.notifier.status(f"{ready}/{len(replicas)} replicas serving")

    def _watchdog(self, replicas: list[Child]) -> None:
        """Pings systemd; a serving replica that sent no ping for the interval is killed (and
        then restarted)."""
        interval = self.notifier.watchdog_seconds
        if interval is None:
            return
        now = time.monotonic()
        for child in replicas:
            if child.ready and child.running and now - child.last_alive > interval:
                log.error("%s sent no watchdog ping for %.0f s: killing it", child.name, interval)
                child.proc.kill()
        if now >= self.next_watchdog:
            self.notifier.notify("WATCHDOG=1")
            self.next_watchdog = now + interval / 3

    # --- stopping ------------------------------------------------------------------------------

    def _drain(self, replicas: list[Child], router: Child | None) -> int:
        """Each replica drains (its frontend finishes in-flight requests up to the drain
        timeout), then the router stops."""
        self.notifier.notify("STOPPING=1", "STATUS=draining")
        for child in replicas:
            if child.running:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.serve_args.drain_timeout + 2 * STOP_GRACE_S
        clean = True
        for child in replicas:
            if child.proc is None:
                continue
            try:
                clean = child.proc.wait(max(0.0, deadline - time.monotonic())) == 0 and clean
            except subprocess.TimeoutExpired:
                log.error("%s did not finish draining in time; killing it", child.name)
                clean = False
        if router is not None and router.running:
            router.proc.send_signal(signal.SIGTERM)
            try:
                router.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        return 0 if clean else EXIT_CHILD_LOST

    def _kill_all(self, replicas: list[Child], router: Child | None) -> None:
        for child in [*replicas, *([router] if router else [])]:
            if child.running:
                child.proc.kill()
            if child.proc is not None:
                child.proc.wait()


def _healthy(plan: ReplicaPlan) -> bool:
    host = "127.0.0.1" if plan.router_host in ("0.0.0.0", "") else plan.router_host
    host = f"[{host}]" if ":" in str(host) else host
    try:
        with urllib.request.urlopen(f"http://{host}:{plan.router_port}/health", timeout=0.5) as r:
            return r.status == 200
    except OSError:
        return False
