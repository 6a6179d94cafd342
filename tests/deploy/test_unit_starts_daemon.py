"""The daemon started exactly as deploy/cpud.service starts it (its ExecStart, its Environment=
lines, an EnvironmentFile made from deploy/cpud.env, and what systemd itself passes: the
runtime directory, the notify socket, the watchdog interval), without systemd: it tells READY,
serves a request, keeps its IPC sockets in the runtime directory, and drains on SIGTERM to the
main process alone (KillMode=mixed)."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

import httpx
from deploy_helpers import parse_unit, timespan_seconds

from cpud_server_helpers import Server, child_pids, free_port, wait_healthy
from fake_notify import FakeNotifySocket

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def unit_command(service: dict[str, list[str]]) -> list[str]:
    argv = shlex.split(service["ExecStart"][0])
    assert argv[0] == "/opt/cpud/venv/bin/cpud"
    return [shutil.which("cpud"), *argv[1:]]


def unit_environment(service: dict[str, list[str]], specifiers: dict[str, str]) -> dict[str, str]:
    env = {}
    for line in service.get("Environment", []):
        for assignment in shlex.split(line):
            name, value = assignment.split("=", 1)
            for spec, path in specifiers.items():
                value = value.replace(spec, path)
            env[name] = value
    return env


def environment_file(text: str) -> dict[str, str]:
    """systemd's EnvironmentFile= syntax: NAME=VALUE lines, # comments."""
    env = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, value = line.split("=", 1)
            env[name.strip()] = value.strip().strip('"')
    return env


def test_daemon_started_like_the_unit_serves_and_drains(model_factory, tmp_path):
    service = parse_unit((DEPLOY / "cpud.service").read_text())["Service"]
    runtime = tmp_path / "run" / "cpud"
    runtime.mkdir(parents=True, mode=0o700)
    state, cache = tmp_path / "state" / "cpud", tmp_path / "cache"
    state.mkdir(parents=True)
    port = free_port()
    # The operator's /etc/cpud/cpud.env: the shipped file with its settings filled in.
    env_file = tmp_path / "cpud.env"
    env_file.write_text(
        (DEPLOY / "cpud.env").read_text()
        + f"\nCPUD_MODEL={model_factory('qwen3')}\nCPUD_PORT={port}\n"
        + "CPUD_TP=2\nVLLM_CPU_OMP_THREADS_BIND=0|1\nCPUD_DTYPE=float32\n"
        + "CPUD_MAX_MODEL_LEN=256\nCPUD_SERVED_MODEL_NAME=tiny\n"
    )
    notify = FakeNotifySocket(tmp_path / "notify.sock")
    watchdog_usec = int(timespan_seconds(service["WatchdogSec"][0]) * 1e6)
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        **unit_environment(service, {"%C": str(cache), "%S": str(state.parent)}),
        **environment_file(env_file.read_text()),
        "RUNTIME_DIRECTORY": str(runtime),
        "STATE_DIRECTORY": str(state),
        "CACHE_DIRECTORY": str(cache / "cpud"),
        "NOTIFY_SOCKET": str(notify.path),
        "WATCHDOG_USEC": str(watchdog_usec),
    }
    log_path = tmp_path / "daemon.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            unit_command(service), env=env, cwd=state, stdout=log, stderr=subprocess.STDOUT
        )
    server = Server(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        notify.wait_for("READY=1", 90)
        wait_healthy(server)
        body = {"model": "tiny", "prompt": "unit", "max_tokens": 6, "ignore_eos": True}
        response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 6
        assert len(child_pids(proc.pid, b"cpud.ranks.worker")) == 2
        # The sockets live in the private runtime directory systemd made for the unit.
        (private,) = [p for p in runtime.iterdir() if p.is_dir()]
        assert stat.S_IMODE(private.stat().st_mode) == 0o700
        assert any(stat.S_ISSOCK(p.stat().st_mode) for p in private.iterdir())
        children = child_pids(proc.pid)
        # KillMode=mixed: SIGTERM to the main process only.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timespan_seconds(service["TimeoutStopSec"][0])) == 0, server.log()
        assert notify.times("STOPPING=1")
        time.sleep(0.2)
        assert not any(Path(f"/proc/{pid}").exists() for pid in children)
        assert not list(runtime.iterdir()), "the runtime directory was not cleaned up"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        notify.close()
