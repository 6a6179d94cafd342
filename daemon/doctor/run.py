"""Collect every check for one set of inputs and print the verdicts."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from cpud.doctor.args import inputs_from_args
from cpud.doctor.binding_check import binding_check
from cpud.doctor.inputs import DoctorInputs
from cpud.doctor.machine import (
    cpu_check,
    dtype_check,
    huge_pages_check,
    native_check,
    smt_check,
)
from cpud.doctor.memory_check import memory_check
from cpud.doctor.model_check import model_check
from cpud.doctor.planning import plan
from cpud.doctor.replicas_check import replicas_check
from cpud.doctor.report import Check, exit_code, render, report
from cpud.doctor.runtime import openmp_check, threads_check
from cpud.doctor.spec_check import spec_check
from cpud.doctor.syscalls import numa_syscalls_check
from cpud.doctor.topology_checks import cgroup_check, numa_check


def version_check() -> Check:
    import platform

    import torch

    from cpud import __version__

    value = {
        "version": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    return Check(
        "cpud", "ok", f"{__version__} (torch {torch.__version__}, Python {value['python']})", value
    )


def _guarded(name: str, build: Callable[[], Check]) -> Check:
    try:
        return build()
    except Exception as exc:  # one broken check must not hide the others
        reason = f"the check itself failed: {type(exc).__name__}: {exc}"
        return Check(name, "fail", reason, {"error": reason}, ("report this as a cpud bug",))


def collect(inputs: DoctorInputs) -> list[Check]:
    """Every item, in the order an operator reads them: machine, placement, runtime."""
    planning = plan(inputs)
    builders: list[tuple[str, Callable[[], Check]]] = [
        ("cpud", version_check),
        ("cpu", lambda: cpu_check(inputs)),
        ("native kernels", lambda: native_check(inputs)),
        ("dtype", lambda: dtype_check(inputs)),
        ("model", lambda: model_check(planning)),
        ("smt", lambda: smt_check(inputs, planning)),
        ("huge pages", lambda: huge_pages_check(inputs)),
        ("numa", lambda: numa_check(planning)),
        ("cgroup", lambda: cgroup_check(inputs, planning)),
        ("binding", lambda: binding_check(inputs, planning)),
        ("memory plan", lambda: memory_check(planning)),
        ("openmp", lambda: openmp_check(inputs.proc_root)),
        ("threads", lambda: threads_check(planning)),
        ("numa syscalls", lambda: numa_syscalls_check(inputs.syscalls)),
    ]
    if inputs.data_parallel_size != 1:  # after the memory plan
        builders.insert(11, ("replicas", lambda: replicas_check(planning)))
    if inputs.engine.speculative_config is not None:  # after the model
        builders.insert(5, ("speculative decoding", lambda: spec_check(planning)))
    return [_guarded(name, build) for name, build in builders]


def run_command(args: argparse.Namespace) -> int:
    """`cpud doctor`: exit 0 when no item failed, 1 when one did (bad arguments raise
    CpudError, which the CLI turns into exit 2)."""
    checks = collect(inputs_from_args(args))
    text = json.dumps(report(checks), indent=2) if args.json else render(checks)
    sys.stdout.write(text + "\n")
    return exit_code(checks)
