"""Everything the doctor looks at, as one frozen value: the settings cpud would start with and
where the machine is read from (roots and system calls are parameters so tests fabricate them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cpud.doctor.syscalls import LibcNumaSyscalls, NumaSyscalls
from cpud.settings.config import EngineArgs


@dataclass(frozen=True)
class DoctorInputs:
    # the serving settings to check (flags; env vars are read where cpud reads them)
    engine: EngineArgs = field(default_factory=EngineArgs)
    sysfs_root: Path = Path("/sys")
    proc_root: Path = Path("/proc")
    # None: <sysfs_root>/fs/cgroup, where cpud's own discovery looks
    cgroup_root: Path | None = None
    syscalls: NumaSyscalls = field(default_factory=LibcNumaSyscalls)
    # --data-parallel-size: replicas on this host, each with --tp ranks
    data_parallel_size: int = 1

    @property
    def cgroup_dir(self) -> Path:
        return self.cgroup_root if self.cgroup_root is not None else self.sysfs_root / "fs/cgroup"
