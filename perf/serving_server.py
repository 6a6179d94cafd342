"""The servers perf/bench_serving.py measures: a target's command line, its process (started in
its own session, ready at the first 200 from /health, stopped with its whole group), the warm-up
before the measured runs, and the Ledger of what the rounds learn about each target. A process
that dies or a 5xx reply is a ServerCrash, so that the benchmark can tell a crashing server from
a slow or refusing one.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_line(text: str) -> str:
    return " ".join(text.split())


@dataclass
class Target:
    """A server the benchmark starts: command, environment, readiness URL."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    port: int
    model: str  # the "model" field of requests
    ready_timeout_s: float = 180
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    for key in [k for k in env if k.startswith("VLLM_")]:
        env.pop(key)  # cpud reads vLLM's variables too; each target gets its own
    return env


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its live descendants (from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        parents[int(entry.name)] = int(fields[1])
        cpu[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(cpu.get(p, 0.0) for p in tree)


class ServerCrash(RuntimeError):
    """The server's process died, or it answered 5xx."""


class Server:
    """One started target; stop() ends its whole process group (it is a session leader)."""

    def __init__(self, target: Target, log_dir: Path) -> None:
        self.target = target
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{target.name}-{target.port}.log"
        self.proc: subprocess.Popen | None = None  # type: ignore[type-arg]

    def start(self) -> float:
        """Starts the server and returns seconds from spawn to /health answering 200."""
        log = open(self.log_path, "w")  # noqa: SIM115 - the child keeps it
        started = time.perf_counter()
        self.proc = subprocess.Popen(
            self.target.cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.target.env,
            start_new_session=True,
            cwd="/",
        )
        log.close()
        deadline = started + self.target.ready_timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise ServerCrash(f"{self.exit_text()} before ready: {self.tail()}")
            try:
                with urllib.request.urlopen(self.target.url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return time.perf_counter() - started
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"not ready after {self.target.ready_timeout_s:.0f} s: {self.tail()}")

    def tail(self, lines: int = 6) -> str:
        text = self.log_path.read_text(errors="replace").strip().splitlines()
        keep = [t for t in text if "rror" in t or "xception" in t] or text
        return one_line(" | ".join(keep[-lines:]))

    def exit_text(self) -> str:
        """'exited 1', or 'killed by SIGSEGV' for a process a signal ended."""
        code = self.proc.returncode if self.proc else None
        if code is not None and code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                pass
        return f"exited {code}"

    def dead(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def check_alive(self, during: str) -> None:
        if self.dead():
            raise ServerCrash(f"{self.exit_text()} during {during}: {self.tail()}")

    def cpu_seconds(self) -> float:
        return tree_cpu_seconds(self.proc.pid) if self.proc else 0.0

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 40), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # the group may still hold children that outlived the leader
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass
class Ledger:
    """What the rounds on one model learn about its targets besides the figures."""

    label: str = ""  # prefixed to failures: the file, in --gguf / --quantized runs
    status: dict[str, str] = field(default_factory=dict)
    start: dict[str, list[float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    repack_off: dict[str, str] = field(default_factory=dict)  # target -> the crash that led to it
    commands: dict[str, str] = field(default_factory=dict)  # target -> its last command line

    def failed(self, index: int, name: str, exc: BaseException) -> None:
        kind = "failed" if self.start.get(name) else "unavailable"
        reason = one_line(f"{kind}: {type(exc).__name__}: {exc}")
        self.failures.append(f"{self.label}round {index + 1}, {name}: {reason}")
        if not self.start.get(name):
            self.status[name] = reason
        print(f"{self.label}{name}: {reason}", flush=True)

    def start_to_ready(self) -> dict[str, Any]:
        return {
            name: {"median_s": statistics.median(values), "samples_s": values}
            for name, values in self.start.items()
            if values
        }


def prompt_ids(tokenizer: Path, isl: int) -> list[int]:
    """isl token ids of English text under the directory's tokenizer.json (so within any
    vocabulary, a small fixture's too); the load generator's ids when it has none."""
    path = tokenizer / "tokenizer.json"
    if not path.is_file():
        import loadgen

        return loadgen.prompt_ids(0, isl, 0)
    from tokenizers import Tokenizer

    text = "The quick brown fox jumps over the lazy dog, then sleeps in the sun. " * isl
    return Tokenizer.from_file(str(path)).encode(text).ids[:isl]


def warm_up(server: Server, tokenizer: Path, isl: int, clients: int = 4) -> None:
    """Pages the weights in and runs the first batches: `clients` concurrent prompts of isl
    tokens, 8 tokens out. ServerCrash on a 5xx reply or a dead server."""
    from concurrent.futures import ThreadPoolExecutor

    ids = prompt_ids(tokenizer, isl)

    def one(index: int) -> None:
        body = {"model": server.target.model, "prompt": ids[index:] + ids[:index]}
        body |= {"max_tokens": 8, "ignore_eos": True}
        request = urllib.request.Request(
            server.target.url + "/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=600) as reply:
                reply.read()
        except urllib.error.HTTPError as exc:
            said = one_line(exc.read().decode(errors="replace"))[:300]
            if exc.code >= 500:
                raise ServerCrash(f"warm-up: HTTP {exc.code}: {said}") from None
            raise RuntimeError(f"warm-up: HTTP {exc.code}: {said}") from None
        except OSError:
            server.check_alive("the warm-up")
            raise

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(clients)))
    server.check_alive("the warm-up")
