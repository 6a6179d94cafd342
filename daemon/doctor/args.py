"""`cpud doctor` flags: the settings that decide placement and memory (declared in
cpud.settings, the same flags as `cpud serve`), --json, and hidden testing aids that point
discovery at fabricated trees.

Kept free of heavy imports: the CLI builds every subcommand's parser on each start.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from cpud.settings import DOCTOR
from cpud.settings.flags import add_flags

if TYPE_CHECKING:
    from cpud.doctor.inputs import DoctorInputs

EPILOG = (
    "exit status: 0 no item failed (warnings allowed), 1 at least one item failed, "
    "2 bad arguments (e.g. --model is not a directory, unknown --dtype)"
)


def add_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    add_flags(parser, DOCTOR, check_positive=True)
    # testing aids: discovery on fabricated sysfs/procfs/cgroupfs trees
    parser.add_argument("--sysfs-root", type=Path, default=Path("/sys"), help=argparse.SUPPRESS)
    parser.add_argument("--proc-root", type=Path, default=Path("/proc"), help=argparse.SUPPRESS)
    parser.add_argument("--cgroup-root", type=Path, help=argparse.SUPPRESS)


def inputs_from_args(args: argparse.Namespace) -> DoctorInputs:
    """The inputs to check; ConfigError (exit 2) where the arguments name nothing usable."""
    from cpud.doctor.inputs import DoctorInputs
    from cpud.model.cpu_features import parse_dtype
    from cpud.model.model_dir import resolve_model_dir
    from cpud.settings.config import EngineArgs
    from cpud.settings.flags import engine_kwargs

    if args.model is not None:
        resolve_model_dir(args.model)
    if args.dtype.lower() != "auto":
        parse_dtype(args.dtype)
    engine = EngineArgs(model=args.model, **engine_kwargs(vars(args)))
    return DoctorInputs(
        engine=engine,
        sysfs_root=args.sysfs_root,
        proc_root=args.proc_root,
        cgroup_root=args.cgroup_root,
        data_parallel_size=args.data_parallel_size,
    )
