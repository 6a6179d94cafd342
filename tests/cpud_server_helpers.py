"""Start `cpud serve` on loopback and read its metrics (shared by the HTTP tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_ports(n: int) -> int:
    """A port p where p .. p + n - 1 are all free now (a server with replicas on the next
    ports): a free port's neighbours may be another process's."""
    for _ in range(100):
        base = free_port()
        socks = []
        try:
            for port in range(base, base + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no run of {n} free ports found")


@dataclass
class Server:
    proc: subprocess.Popen
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def launch(
    model_dir: Path,
    log_path: Path,
    *extra: str,
    env: dict | None = None,
    port: int | None = None,
    new_session: bool = False,
) -> Server:
    """`cpud serve` started, not yet healthy."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "cpud.cli", "serve", "--model", str(model_dir)]
    cmd += ["--port", str(port), "--served-model-name", "tiny", "--dtype", "float32", *extra]
    log = log_path.open("w")
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        start_new_session=new_session,
    )
    return Server(proc, f"http://127.0.0.1:{port}", log_path)


def wait_healthy(server: Server, timeout: float = 60) -> Server:
    proc = server.proc
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"cpud serve exited {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.base_url + "/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"cpud serve did not become healthy:\n{server.log()}")


def start_server(model_dir: Path, log_path: Path, *extra: str, env: dict | None = None) -> Server:
    return wait_healthy(launch(model_dir, log_path, *extra, env=env))


def metric(server: Server, name: str) -> float:
    text = httpx.get(server.base_url + "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def rank_pids(server_pid: int) -> list[int]:
    return child_pids(server_pid, b"cpud.ranks.worker")


def child_pids(server_pid: int, marker: bytes = b"") -> list[int]:
    """Children of the supervisor whose command line contains `marker`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            if parent == server_pid and marker in cmdline:
                pids.append(int(entry.name))
    return pids


def stream_times(base_url: str, max_tokens: int, times: list[float]) -> None:
    """Streams a completion of max_tokens tokens (ignoring EOS), appending each event's arrival
    time to `times`: the bystander whose pace the availability tests compare."""
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": max_tokens, "stream": True}
    body["ignore_eos"] = True
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
