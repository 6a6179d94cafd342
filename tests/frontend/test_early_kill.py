"""kill -9 of the supervisor at any point of `cpud serve`'s start: within seconds no process of
that daemon is left and its port is free; the runtime directory it left is removed by the next
start (or the sweep it runs), and only directories whose owner is dead are."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cpud_server_helpers import Server, free_port, launch

DEAD_WITHIN_S = 8.0
SERVING = "cpud.supervisor INFO ready in"  # every rank ready, HTTP serving


def live_processes(*markers: str) -> list[int]:
    """Pids of live (not zombie) processes whose command line contains every marker."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if all(m in cmdline for m in markers) and live(int(entry.name)):
            pids.append(int(entry.name))
    return pids


def live(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def describe(pid: int) -> str:
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "gone"
    return " ".join(line for line in status if line.startswith(("State", "PPid"))) + " " + cmdline


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def accepts(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.2)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def runtime_dirs(parent: Path) -> list[Path]:
    """Runtime directories under `parent`, staging ones (hidden) included."""
    return sorted(p for p in parent.iterdir() if p.name.startswith(("cpud-", ".cpud-")))


class Start:
    """One `cpud serve` in a private runtime parent, and what can be seen of its start."""

    def __init__(self, model: Path, parent: Path, log: Path, *extra: str):
        self.parent = parent
        self.port = free_port()
        env = {"RUNTIME_DIRECTORY": str(parent), "XDG_RUNTIME_DIR": str(parent)}
        extra = ("--max-model-len", "256", *extra)
        self.server: Server = launch(model, log, *extra, env=env, port=self.port)
        self.seen: set[int] = set()
        self.spawned_at: dict[str, float] = {}

    def children(self, marker: str = "") -> list[int]:
        """Its live frontend and ranks (their spec files lie under the runtime parent)."""
        pids = live_processes(f"{self.parent}/", marker)
        self.seen.update(pids)
        return pids

    def wait_for(self, when: Callable[[Start, float], bool]) -> None:
        began = time.monotonic()
        while not when(self, began):
            assert self.server.proc.poll() is None, self.server.log()
            assert time.monotonic() - began < 60, f"never reached:\n{self.server.log()}"
            self.children()
            time.sleep(0.002)

    def logged(self, text: str) -> bool:
        return text in self.server.log()


def after(seconds: float) -> Callable[[Start, float], bool]:
    return lambda start, began: time.monotonic() - began >= seconds


def spawned(marker: str, count: int = 1, then_s: float = 0.0) -> Callable[[Start, float], bool]:
    def ready(start: Start, began: float) -> bool:
        if marker not in start.spawned_at and len(start.children(marker)) >= count:
            start.spawned_at[marker] = time.monotonic()
        seen = start.spawned_at.get(marker)
        return seen is not None and time.monotonic() - seen >= then_s

    return ready


def logged(text: str) -> Callable[[Start, float], bool]:
    return lambda start, began: start.logged(text)


TP2 = ("--tp", "2", "--bind", "0|1")
POINTS = {
    "at-exec": ((), after(0)),
    "interpreter-start": ((), after(0.3)),
    "runtime-dir-made": ((), lambda start, began: bool(runtime_dirs(start.parent))),
    "frontend-forked": ((), spawned("frontend")),
    "rank-forked": ((), spawned("rank0.json")),
    "frontend-importing": ((), spawned("frontend", then_s=0.4)),
    "port-bound": ((), lambda start, began: accepts(start.port)),
    "rank-ready": ((), logged("rank 0 ready")),
    "tp2-ranks-forked": (TP2, spawned("rank", count=2)),
    "tp2-serving": (TP2, logged(SERVING)),
}


@pytest.fixture
def parent():
    # Short: IPC socket paths under it must stay below the 107-byte limit of AF_UNIX.
    path = Path(tempfile.mkdtemp(prefix="ek", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def kill_at(start: Start, when: Callable[[Start, float], bool]) -> None:
    start.wait_for(when)
    start.server.proc.kill()
    start.server.proc.wait(5)
    start.children()


def assert_nothing_left(start: Start) -> None:
    deadline = time.monotonic() + DEAD_WITHIN_S
    while time.monotonic() < deadline:
        start.children()
        if not any(live(pid) for pid in start.seen) and port_is_free(start.port):
            break
        time.sleep(0.05)
    left = {pid: describe(pid) for pid in start.seen if live(pid)}
    assert not left, f"orphans {left} of the killed supervisor:\n{start.server.log()}"
    assert port_is_free(start.port), "the port is still held"


@pytest.mark.parametrize("point", list(POINTS))
def test_supervisor_killed_during_start_leaves_nothing(model_factory, tmp_path, parent, point):
    extra, when = POINTS[point]
    start = Start(model_factory("qwen3"), parent, tmp_path / "serve.log", *extra)
    try:
        kill_at(start, when)
        assert_nothing_left(start)
        from cpud.engine.multiproc import remove_dead_runtime_dirs

        removed = remove_dead_runtime_dirs(str(parent))
        assert not runtime_dirs(parent), (removed, runtime_dirs(parent))
    finally:
        for pid in start.seen:
            if live(pid):
                os.kill(pid, signal.SIGKILL)


def test_next_start_removes_what_a_killed_daemon_left(model_factory, tmp_path, parent):
    model = model_factory("qwen3")
    first = Start(model, parent, tmp_path / "first.log", *TP2)
    kill_at(first, logged(SERVING))
    assert_nothing_left(first)
    [dead] = runtime_dirs(parent)
    assert (dead / "allreduce.shm").exists()
    second = Start(model, parent, tmp_path / "second.log")
    try:
        second.wait_for(logged(SERVING))
        [own] = runtime_dirs(parent)
        assert own != dead and not dead.exists()
    finally:
        assert second.server.stop() == 0, second.server.log()
    assert not runtime_dirs(parent)


def make_dead_owner_dir(parent: Path) -> Path:
    code = "from cpud.engine.multiproc import make_runtime_dir; print(make_runtime_dir())"
    env = {**os.environ, "RUNTIME_DIRECTORY": str(parent)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    return Path(out.stdout.strip())


def test_sweep_removes_only_this_users_dirs_of_dead_owners(parent, monkeypatch):
    from cpud.engine.multiproc import make_runtime_dir, remove_dead_runtime_dirs

    monkeypatch.setenv("RUNTIME_DIRECTORY", str(parent))
    alive = Path(make_runtime_dir())
    dead = make_dead_owner_dir(parent)
    assert (dead / "owner").exists()
    (dead / "allreduce.shm").write_bytes(b"x" * 4096)
    owner = (alive / "owner").read_text().split()
    reused = parent / "cpud-reused"
    reused.mkdir()
    (reused / "owner").write_text(f"{os.getpid()} {int(owner[1]) + 1} {owner[2]}\n")
    foreign_ns = parent / "cpud-otherns"
    foreign_ns.mkdir()
    (foreign_ns / "owner").write_text((dead / "owner").read_text().replace(owner[2], "pid:[1]"))
    unowned = parent / "cpud-unowned"
    unowned.mkdir()
    outside = parent / "outside"
    outside.mkdir()
    (outside / "owner").write_text((dead / "owner").read_text())
    (outside / "keep").write_text("x")
    (parent / "cpud-link").symlink_to(outside)
    not_ours = parent / "other-dead"
    shutil.copytree(dead, not_ours)
    linked_owner = parent / "cpud-linked-owner"
    linked_owner.mkdir()
    (linked_owner / "owner").symlink_to(outside / "owner")
    other_user = parent / "cpud-other-user"
    shutil.copytree(dead, other_user)
    if os.geteuid() == 0:
        for path in (other_user, other_user / "owner"):
            os.chown(path, 65534, 65534)
    staging = parent / ".cpud-staging"
    staging.mkdir()
    abandoned = parent / ".cpud-abandoned"
    abandoned.mkdir()
    os.utime(abandoned, (time.time() - 120, time.time() - 120))
    # Killed between making the staging directory and writing (or finishing) its owner file.
    dead_pid, dead_start, dead_ns = (dead / "owner").read_text().split()
    named = f".cpud-{dead_pid}-{dead_start}-{''.join(filter(str.isdigit, dead_ns))}-"
    killed_staging, killed_writing = parent / f"{named}ab_c1", parent / f"{named}de_f2"
    killed_staging.mkdir()
    killed_writing.mkdir()
    (killed_writing / "owner").write_text("")
    live_staging = parent / f".cpud-{owner[0]}-{owner[1]}-{named.split('-')[3]}-gh_i3"
    live_staging.mkdir()

    removed = remove_dead_runtime_dirs(str(parent))

    chowned = os.geteuid() == 0
    dead_ones = [dead, reused, abandoned, killed_staging, killed_writing]
    dead_ones += [] if chowned else [other_user]
    assert sorted(removed) == sorted(map(str, dead_ones))
    kept = [alive, foreign_ns, unowned, outside / "keep", not_ours, parent / "cpud-link"]
    kept += [staging, live_staging, linked_owner, *([other_user] if chowned else [])]
    for path in kept:
        assert os.path.lexists(path), path
    assert alive.stat().st_mode & 0o777 == 0o700
    assert (alive / "owner").stat().st_mode & 0o777 == 0o600
    shutil.rmtree(alive)
