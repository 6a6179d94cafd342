"""The offline engine's ranks: this process owns them (the daemon's supervisor does that job
when serving). A private 0700 runtime directory holds the IPC sockets and the shared memory
segment; READY from every rank is awaited (any rank that fails or never answers is named),
then plans run in lockstep. Ranks die with their parent (PR_SET_PDEATHSIG), so no orphan
survives any exit path.

A runtime directory names its owner in its `owner` file (pid, start time, pid namespace),
written while the directory still has a hidden staging name, so a `cpud-*` directory never
lacks it; the staging name itself carries the same record, so a directory whose owner was
killed before that file was written is recognised too. An owner killed with SIGKILL cannot
remove its directory: the next one made under the same parent removes every directory whose
owner is gone."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

import zmq

from cpud.engine.rank_client import RankClient
from cpud.engine.rank_group import RankDiedError, RankGroup, RankSlot, RankTimeouts
from cpud.protocol.control import RankStats
from cpud.protocol.step import StepPlan, StepResult
from cpud.settings.config import EngineConfig
from cpud.settings.errors import ConfigError

log = logging.getLogger("cpud.runtime")
RUNTIME_PREFIX = "cpud-"
STAGING_PREFIX = ".cpud-"
ABANDONED_STAGING_S = 60.0  # a staging directory gets its owner record within microseconds
OWNER_FILE = "owner"

__all__ = ["MultiprocExecutor", "RankDiedError", "RankSlot"]


def runtime_parent() -> str:
    return os.environ.get("RUNTIME_DIRECTORY") or os.environ.get("XDG_RUNTIME_DIR") or "/tmp"


def _start_time(pid: int) -> str | None:
    """When process `pid` started (clock ticks after boot); None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def owner_record() -> str | None:
    """This process as a runtime directory's owner: its pid, its start time (which tells a
    reused pid apart) and its pid namespace (outside it, the pid means another process)."""
    start, namespace = _start_time(os.getpid()), _pid_namespace()
    if start is None or namespace is None:
        return None
    return f"{os.getpid()} {start} {namespace}"


def _read_owner(directory: str) -> str | None:
    """The owner record of `directory` when it is a regular file of this user."""
    try:
        fd = os.open(os.path.join(directory, OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            return None
        return file.read(256).decode(errors="replace").strip()


def _staging_prefix(record: str | None) -> str:
    """`.cpud-PID-START-NAMESPACE-`: the owner record in a name made with the directory."""
    if record is None:
        return STAGING_PREFIX
    pid, start, namespace = record.split()
    return f"{STAGING_PREFIX}{pid}-{start}-{''.join(filter(str.isdigit, namespace))}-"


def _staging_owner(name: str) -> str | None:
    """The owner record a staging directory's name carries; None for a name without one."""
    parts = name[len(STAGING_PREFIX) :].split("-")
    if len(parts) != 4 or not all(part.isdigit() for part in parts[:3]):
        return None
    pid, start, namespace = parts[:3]
    return f"{pid} {start} pid:[{namespace}]"


def _owner_dead(record: str) -> bool:
    parts = record.split()
    if len(parts) != 3 or not parts[0].isdigit() or parts[2] != _pid_namespace():
        return False  # unreadable, or from another pid namespace: cannot be checked from here
    return _start_time(int(parts[0])) != parts[1]


def remove_dead_runtime_dirs(parent: str) -> list[str]:
    """Removes the runtime directories under `parent` whose owner is gone (killed with
    SIGKILL, or the machine lost power with the parent on disk); returns their paths. Only this
    user's real directories (never a link) are considered: with an owner record, one owned by a
    live process or by a process of another pid namespace stays; without one, only a staging
    directory abandoned for a minute goes (a `cpud-*` one then predates owner records). A
    staging directory's record is its name's, whatever its `owner` file holds yet."""
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        staging = entry.name.startswith(STAGING_PREFIX)
        if not (staging or entry.name.startswith(RUNTIME_PREFIX)):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            continue
        record = (_staging_owner(entry.name) if staging else None) or _read_owner(entry.path)
        if record is None:
            if not staging or time.time() - info.st_mtime < ABANDONED_STAGING_S:
                continue
        elif not _owner_dead(record):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        owner = "unknown" if record is None else record.split()[0]
        log.info("removed %s, left by a cpud that is gone (pid %s)", entry.path, owner)
        removed.append(entry.path)
    return removed


def make_runtime_dir() -> str:
    """A new private 0700 directory under runtime_parent() that names this process as its
    owner, once the directories of owners that are gone are removed."""
    parent = runtime_parent()
    remove_dead_runtime_dirs(parent)
    record = owner_record()
    staging = tempfile.mkdtemp(prefix=_staging_prefix(record), dir=parent)
    os.chmod(staging, 0o700)
    if record is not None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        with os.fdopen(os.open(os.path.join(staging, OWNER_FILE), flags, 0o600), "w") as file:
            file.write(record + "\n")
    # Only the random part: IPC socket paths under the directory stay short.
    path = os.path.join(parent, RUNTIME_PREFIX + os.path.basename(staging).rsplit("-", 1)[1])
    os.rename(staging, path)
    return path


class MultiprocExecutor:
    def __init__(
        self,
        config: EngineConfig,
        slots: list[RankSlot],
        collective: str = "shm",
        timeouts: RankTimeouts | None = None,
    ):
        if len(slots) != config.tp:
            raise ConfigError(f"{len(slots)} rank placements for tp={config.tp}")
        timeouts = timeouts or RankTimeouts()
        self.runtime_dir = make_runtime_dir()
        self.ctx = zmq.Context()
        self.group: RankGroup | None = None
        self.client: RankClient | None = None
        self.lost = False  # a rank died or hung: nothing is left to finish at shutdown
        try:
            self.group = RankGroup(
                self.ctx, self.runtime_dir, config.spec(), slots, collective, timeouts
            )
            self.ready = self.group.wait_ready()
            self.client = RankClient(
                self.ctx, self.runtime_dir, config.tp, self.group.poll, timeouts.step
            )
        except BaseException:
            self.shutdown()
            raise

    def execute(self, plan: StepPlan) -> StepResult:
        try:
            return self.client.execute(plan)
        except RankDiedError:
            self.lost = True
            raise

    def check_health(self) -> None:
        try:
            self.client.check_health()
        except RankDiedError:
            self.lost = True
            raise

    def rank_stats(self) -> list[RankStats]:
        return self.client.rank_stats()

    def shutdown(self) -> None:
        if self.ctx.closed:
            return
        if self.client is not None:
            self.client.shutdown()
        if self.group is not None and self.lost:
            self.group.kill()  # a hung rank (or one waiting on it) would not stop on request
        elif self.group is not None:
            self.group.stop()
        self.ctx.destroy(linger=1000)  # sockets a failed start left open too
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
