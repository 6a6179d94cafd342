"""`cpud serve -dp 2` on this machine: two replicas of one core each, each on its own port (or
behind vllm-router). A replica whose rank is killed fails its requests fast and restarts alone
while the other keeps serving; nothing is left behind when the daemon stops."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from cpud_server_helpers import child_pids, free_ports, launch, wait_healthy
from fake_notify import FakeNotifySocket

pytestmark = pytest.mark.slow

BODY = {"model": "tiny", "prompt": "hello there", "max_tokens": 8, "ignore_eos": True}


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        children = child_pids(todo.pop())
        found += children
        todo += children
    return found


def replica_pid(top: int, index: int) -> int:
    (pid,) = child_pids(top, f"replica{index}.json".encode())
    return pid


def replica_rank(top: int, index: int) -> int:
    (pid,) = child_pids(replica_pid(top, index), b"cpud.ranks.worker")
    return pid


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} did not happen within {timeout:.0f} s")


def complete(url: str) -> int:
    return httpx.post(url + "/v1/completions", json=BODY, timeout=60).status_code


def served(url: str, replica: int) -> float:
    """Completions replica `replica` answered with 200, from its labelled metrics."""
    text = httpx.get(url + "/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith('cpud_requests_total{endpoint="/v1/completions"') and (
            f'replica="{replica}"' in line and 'status="200"' in line
        ):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def runtime_dirs(pids: list[int]) -> set[Path]:
    """The folders of the spec files on the processes' command lines (runtime directories)."""
    found = set()
    for pid in pids:
        for word in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
            if word.endswith(b".json"):
                found.add(Path(word.decode()).parent)
    return found


def stop_and_check_nothing_left(server, top: int) -> None:
    left = descendants(top)
    folders = runtime_dirs(left)
    assert len(folders) >= 3  # ours, and each replica's
    assert server.stop(timeout=90) == 0, server.log()[-3000:]
    time.sleep(0.5)
    alive = [pid for pid in left if Path(f"/proc/{pid}").exists()]
    assert not alive, f"processes left behind: {alive}"
    assert not [f for f in folders if f.exists()], "runtime directories left behind"


def test_killed_rank_fails_its_replica_fast_the_other_serves_it_restarts(model_factory, tmp_path):
    port = free_ports(2)  # replica 1 on port + 1
    notify = FakeNotifySocket(tmp_path / "notify.sock")
    env = {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "15000000"}
    server = launch(model_factory("qwen3"), tmp_path / "log", "-dp", "2", port=port, env=env)
    first, second = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"
    try:
        # systemd hears READY=1 from the top process once both replicas serve
        ready = notify.wait_for("READY=1", 180)
        assert healthy(first) and healthy(second)
        assert f"MAINPID={server.proc.pid}" in [line for _, line in notify.fields()]
        wait_healthy(server, timeout=180)
        wait_until(lambda: healthy(second), 120, "replica 1 serving")
        top = server.proc.pid
        rank = replica_rank(top, 1)
        os.kill(rank, signal.SIGSTOP)  # its next request stays in flight until the kill
        outcome: dict[str, object] = {}

        def request() -> None:
            try:
                outcome["status"] = complete(second)
            except httpx.HTTPError as exc:
                outcome["status"] = type(exc).__name__
            outcome["ended"] = time.monotonic()

        thread = threading.Thread(target=request)
        thread.start()
        time.sleep(1.0)
        assert thread.is_alive(), f"the request ended before the kill: {outcome}"
        killed = time.monotonic()
        os.kill(rank, signal.SIGKILL)
        thread.join(30)
        assert outcome["status"] != 200, outcome
        assert outcome["ended"] - killed < 10, "the request on the lost replica did not fail fast"
        # the other replica serves throughout
        assert complete(first) == 200
        assert server.proc.poll() is None
        wait_until(lambda: healthy(second), 120, "replica 1 restarted")
        assert replica_rank(top, 1) != rank
        assert complete(second) == 200
        assert served(second, 1) >= 1 and served(first, 0) >= 1
        assert "replica 1 exited with code 3" in server.log()
        # one READY=1 for the whole run; the watchdog kept being fed while replica 1 restarted
        assert notify.times("READY=1") == [ready]
        pings = notify.times("WATCHDOG=1")
        assert any(killed < t < killed + 10 for t in pings), pings
        assert any("replica 1 lost" in line for _, line in notify.fields())
        stop_and_check_nothing_left(server, top)
        assert notify.times("STOPPING=1")
    finally:
        notify.close()
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


def test_router_in_front_of_two_replicas_survives_a_lost_replica_and_its_own_death(
    model_factory, tmp_path
):
    port = free_ports(3)  # the router, replicas on port + 1, port + 2
    server = launch(
        model_factory("qwen3"),
        tmp_path / "log",
        "-dp",
        "2",
        "--router",
        "--router-args",
        "--policy round_robin --health-check-interval-secs 1",
        port=port,
    )
    router = f"http://127.0.0.1:{port}"
    replicas = [f"http://127.0.0.1:{port + 1}", f"http://127.0.0.1:{port + 2}"]
    try:
        wait_healthy(server, timeout=240)
        top = server.proc.pid
        assert all(healthy(url) for url in replicas)
        assert [complete(router) for _ in range(6)] == [200] * 6
        assert served(replicas[0], 0) >= 1 and served(replicas[1], 1) >= 1  # round robin

        # the router, killed, is started again
        (router_pid,) = child_pids(top, b"vllm::router")
        os.kill(router_pid, signal.SIGKILL)
        wait_until(lambda: child_pids(top, b"vllm::router") not in ([], [router_pid]), 30, "rerun")
        wait_until(lambda: healthy(router), 60, "the router serving again")

        # a replica lost: the router sends to the other; the replica comes back and gets traffic
        os.kill(replica_rank(top, 1), signal.SIGKILL)
        wait_until(lambda: not healthy(replicas[1]), 30, "replica 1 down")
        assert [complete(router) for _ in range(4)] == [200] * 4
        wait_until(lambda: healthy(replicas[1]), 120, "replica 1 restarted")
        wait_until(
            lambda: complete(router) == 200 and served(replicas[1], 1) >= 1, 90, "replica 1 traffic"
        )
        stop_and_check_nothing_left(server, top)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
