"""deploy/cpud.service: valid for systemd, hardened, and in agreement with the daemon."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
from deploy_helpers import (
    ENV_FILE,
    UNIT,
    allowed_syscalls,
    env_settings,
    parse_unit,
    require_tool,
    run_tool,
    serve_defaults,
    syscall_groups,
    timespan_seconds,
)

SHIPPED_EXEC = "/opt/cpud/venv/bin/cpud"
MAX_EXPOSURE = 2.0
# Syscalls one `cpud serve --tp 2` made while loading, serving completions and chat streams and
# draining on SIGTERM (strace -f -c, 2026-11-21), plus the NUMA calls libnuma may make.
SERVE_SYSCALLS = Path(__file__).with_name("serve_syscalls.txt")
NUMA_SYSCALLS = {"sched_setaffinity", "set_mempolicy", "get_mempolicy", "mbind", "migrate_pages"}


@pytest.fixture(scope="module")
def unit() -> dict[str, dict[str, list[str]]]:
    return parse_unit(UNIT.read_text())


@pytest.fixture(scope="module")
def service(unit) -> dict[str, list[str]]:
    return unit["Service"]


def one(service: dict[str, list[str]], key: str) -> str:
    values = service.get(key, [])
    assert len(values) == 1, f"{key}= should be set once, found {values}"
    return values[0]


def local_cpud() -> str:
    beside_python = Path(sys.executable).with_name("cpud")
    found = str(beside_python) if beside_python.exists() else shutil.which("cpud")
    assert found, "the cpud entry point is not installed (pip install -e .)"
    return found


def test_systemd_analyze_verify_is_clean(tmp_path):
    analyze = require_tool("systemd-analyze")
    text = UNIT.read_text()
    assert f"ExecStart={SHIPPED_EXEC} serve\n" in text
    # The shipped path only exists once installed; verify checks that the binary exists.
    local = tmp_path / "cpud.service"
    local.write_text(text.replace(f"ExecStart={SHIPPED_EXEC}", f"ExecStart={local_cpud()}"))
    result = run_tool(analyze, "verify", local)
    # verify exits 0 on unknown keys and bad values too, only warning: any output is a failure.
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), (
        result.stdout + result.stderr
    )


def test_security_exposure_is_low():
    analyze = require_tool("systemd-analyze")
    result = run_tool(analyze, "security", "--offline=yes", UNIT)
    match = re.search(r"Overall exposure level for cpud\.service: (\d+\.\d+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= MAX_EXPOSURE, result.stdout


def test_lifecycle_settings_match_the_daemon(service, monkeypatch):
    from cpud.cli import EXIT_CONFIG
    from cpud.supervisor import FRONTEND_EXIT_GRACE_S

    defaults = serve_defaults(monkeypatch)
    assert one(service, "Type") == "notify"
    assert one(service, "NotifyAccess") == "main"
    # The daemon's own handling of a silent child (errors to clients, exit 3) must come first.
    assert timespan_seconds(one(service, "WatchdogSec")) > defaults.rank_timeout + 10
    assert one(service, "KillMode") == "mixed"
    assert one(service, "Restart") == "on-failure"
    assert str(EXIT_CONFIG) in one(service, "RestartPreventExitStatus").split()
    # The drain (plus the frontend's grace to exit) must end, and the ranks stop, before
    # systemd sends SIGKILL.
    stop = timespan_seconds(one(service, "TimeoutStopSec"))
    assert stop > defaults.drain_timeout + 10
    assert stop > defaults.drain_timeout + FRONTEND_EXIT_GRACE_S + 5
    documented = env_settings(ENV_FILE.read_text())["CPUD_DRAIN_TIMEOUT"]
    assert stop > float(documented) + 10
    # Loading gets its own, clearer, timeout inside cpud before systemd gives up on the start.
    start = timespan_seconds(one(service, "TimeoutStartSec"))
    assert start > defaults.ready_timeout + 30
    assert start > float(env_settings(ENV_FILE.read_text())["CPUD_READY_TIMEOUT"]) + 30
    assert one(service, "ExecStart") == f"{SHIPPED_EXEC} serve"
    assert one(service, "EnvironmentFile") == "-/etc/cpud/cpud.env"


def test_directories(service):
    assert one(service, "RuntimeDirectory") == "cpud"
    assert one(service, "RuntimeDirectoryMode") == "0700"
    assert "cpud/models" in one(service, "StateDirectory").split()
    cache = one(service, "CacheDirectory").split()[0]
    # The embedded model is generated into CPUD_CACHE_DIR, which must be writable.
    assert f"CPUD_CACHE_DIR=%C/{cache}" in service["Environment"]


def test_hardening_settings(service):
    expected = {
        "CapabilityBoundingSet": "",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "PrivateDevices": "yes",
        "ProtectKernelTunables": "yes",
        "ProtectKernelModules": "yes",
        "ProtectKernelLogs": "yes",
        "ProtectControlGroups": "yes",
        "RestrictNamespaces": "yes",
        "LockPersonality": "yes",
        "SystemCallArchitectures": "native",
        "SystemCallErrorNumber": "EPERM",
    }
    assert {key: one(service, key) for key in expected} == expected
    assert one(service, "RestrictAddressFamilies").split() == ["AF_UNIX", "AF_INET", "AF_INET6"]
    # oneDNN JIT-compiles kernels into writable+executable pages (mprotect RWX, seen with strace
    # under torch.nn.functional.linear): the ranks would die.
    assert one(service, "MemoryDenyWriteExecute") == "no"
    # Ranks read /proc/cpuinfo; ProcSubset=pid would hide it.
    assert "ProcSubset" not in service


def test_syscall_filter_keeps_pinning_and_numa_calls(service):
    analyze = require_tool("systemd-analyze")
    allowed = allowed_syscalls(service["SystemCallFilter"], syscall_groups(analyze))
    needed = set(SERVE_SYSCALLS.read_text().split()) | NUMA_SYSCALLS
    assert len(needed) > 80
    assert not needed - allowed, f"denied: {sorted(needed - allowed)}"
    assert not {"reboot", "init_module", "mount", "ptrace"} & allowed
