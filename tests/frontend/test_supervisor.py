"""The supervisor of `cpud serve`: sd_notify READY/WATCHDOG/STOPPING/STATUS against a fake
NOTIFY_SOCKET, every way a start can end (stopped while loading, a rank that never answers, a
port already taken) and signals to the whole process group; never a process left behind."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from cpud_server_helpers import child_pids, launch, metric, rank_pids, wait_healthy
from fake_notify import FakeNotifySocket

TP2 = ("--tp", "2", "--bind", "0|1", "--max-model-len", "256")


@pytest.fixture
def notify(tmp_path):
    sock = FakeNotifySocket(tmp_path / "notify.sock")
    yield sock
    sock.close()


@pytest.fixture
def servers():
    started = []
    yield started
    for srv in started:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()


def gone(pids: list[int]) -> bool:
    return not any(Path(f"/proc/{pid}").exists() for pid in pids)


def wait_for_children(pid: int, marker: bytes, count: int, timeout: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(found := child_pids(pid, marker)) >= count:
            return found
        time.sleep(0.01)
    raise AssertionError(f"{count} children {marker!r} of {pid} never appeared")


def test_ready_only_when_every_rank_is_ready_then_watchdog_until_a_rank_hangs(
    model_factory, tmp_path, notify, servers
):
    env = {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "1000000"}
    srv = launch(model_factory("qwen3"), tmp_path / "s.log", *TP2, "--rank-timeout", "10", env=env)
    servers.append(srv)
    ready_at = notify.wait_for("READY=1", 60)
    fields = [f for t, f in notify.fields() if t <= ready_at]
    statuses = [f for f in fields if f.startswith("STATUS=")]
    assert "STATUS=loading: 2/2 ranks ready" in statuses, statuses
    assert statuses.index("STATUS=loading: 2/2 ranks ready") > statuses.index(
        "STATUS=loading: 0/2 ranks ready"
    )
    assert f"MAINPID={srv.proc.pid}" in [f for _, f in notify.fields()]
    assert httpx.get(srv.base_url + "/health").status_code == 200
    # Healthy: pings every third of WatchdogSec.
    time.sleep(2)
    assert len(notify.times("WATCHDOG=1")) >= 4
    ranks = rank_pids(srv.proc.pid)
    os.kill(ranks[1], signal.SIGSTOP)
    stopped_at = time.monotonic()
    code = srv.proc.wait(30)
    lost_at = time.monotonic()
    pings = notify.times("WATCHDOG=1")
    # Pings stop once the rank's heartbeat is stale (5 s), well before it is declared lost
    # (10 s), and none come after.
    assert pings[-1] < stopped_at + 6.5, (pings[-1] - stopped_at, lost_at - stopped_at)
    assert lost_at - stopped_at > 9
    assert code == 3, srv.log()
    assert "rank 1" in srv.log() and "no heartbeat" in srv.log()
    time.sleep(0.2)
    assert gone(ranks)


def test_sigterm_says_stopping_then_drains_and_exits_0(model_factory, tmp_path, notify, servers):
    srv = wait_healthy(
        launch(model_factory("qwen3"), tmp_path / "s.log", env={"NOTIFY_SOCKET": str(notify.path)})
    )
    servers.append(srv)
    children = child_pids(srv.proc.pid)
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(30) == 0
    assert notify.times("STOPPING=1")
    assert notify.times("READY=1")[0] < notify.times("STOPPING=1")[0]
    assert "WATCHDOG=1" not in [f for _, f in notify.fields()]  # no WATCHDOG_USEC given
    time.sleep(0.2)
    assert gone(children)


def test_sigterm_while_loading_stops_everything_promptly(model_factory, tmp_path, servers):
    srv = launch(model_factory("llama"), tmp_path / "s.log", *TP2)
    servers.append(srv)
    ranks = wait_for_children(srv.proc.pid, b"cpud.ranks.worker", 2)
    frontend = child_pids(srv.proc.pid, b"cpud.frontend.server")
    srv.proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    assert srv.proc.wait(15) == 0, srv.log()
    assert time.monotonic() - started < 5
    time.sleep(0.2)
    assert gone(ranks + frontend)


def test_rank_that_never_answers_the_handshake_is_named(model_factory, tmp_path, servers):
    srv = launch(model_factory("llama"), tmp_path / "s.log", *TP2, "--ready-timeout", "10")
    servers.append(srv)
    ranks = wait_for_children(srv.proc.pid, b"rank1.json", 1)
    os.kill(ranks[0], signal.SIGSTOP)
    all_children = child_pids(srv.proc.pid)
    assert srv.proc.wait(45) == 3
    assert "rank(s) [1] did not report ready within 10 s" in srv.log()
    time.sleep(0.2)
    assert gone(all_children)


def test_port_already_taken_exits_2_with_the_reason(model_factory, tmp_path, servers):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        srv = launch(model_factory("llama"), tmp_path / "s.log", port=port)
        servers.append(srv)
        assert srv.proc.wait(60) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in srv.log()
    assert "Traceback" not in srv.log()


def test_sigterm_to_the_whole_process_group_still_drains(model_factory, tmp_path, servers):
    """`timeout`, `kill -- -PGID` and KillMode=control-group signal every process at once: the
    ranks ignore it, the frontend and supervisor drain, the request in flight completes."""
    srv = wait_healthy(launch(model_factory("qwen3"), tmp_path / "s.log", *TP2, new_session=True))
    servers.append(srv)
    children = child_pids(srv.proc.pid)
    result: dict = {}
    body = {"prompt": "go", "max_tokens": 120, "n": 2, "ignore_eos": True}

    def call() -> None:
        response = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=60)
        result["status"], result["body"] = response.status_code, response.json()

    worker = threading.Thread(target=call)
    worker.start()
    deadline = time.monotonic() + 10
    while metric(srv, "cpud_requests_running") < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(srv.proc.pid, signal.SIGTERM)
    worker.join(60)
    assert result["status"] == 200, result
    assert result["body"]["usage"]["completion_tokens"] == 240
    assert srv.proc.wait(30) == 0, srv.log()
    time.sleep(0.2)
    assert gone(children)
