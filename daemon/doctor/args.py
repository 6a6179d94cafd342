"""`cpud doctor` flags: the serving flags that decide placement and memory (same names as
`cpud serve`), --json, and hidden testing aids that point discovery at fabricated trees.

Kept free of heavy imports: the CLI builds every subcommand's parser on each start.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from cpud.doctor.inputs import DoctorInputs

N = TypeVar("N", int, float)

EPILOG = (
    "exit status: 0 no item failed (warnings allowed), 1 at least one item failed, "
    "2 bad arguments (e.g. --model is not a directory, unknown --dtype)"
)


def _positive(kind: Callable[[str], N]) -> Callable[[str], N]:
    def parse(text: str) -> N:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return parse


def add_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--model", help="Hugging Face model directory (default: embedded fixture)")
    parser.add_argument("--dtype", default="auto", help="bfloat16, float16, float32 or auto")
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=("auto", "none", "q8_0", "q4_0", "q4_k"),
        help="as for serve: which weights run the int8 kernels",
    )
    parser.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=_positive(int), default=1)
    parser.add_argument("--max-model-len", type=_positive(int), help="context length in tokens")
    parser.add_argument("--block-size", type=_positive(int), default=16)
    parser.add_argument("--max-num-seqs", type=_positive(int), default=256)
    parser.add_argument("--max-num-batched-tokens", type=_positive(int))
    parser.add_argument(
        "--kv-cache-space",
        type=_positive(float),
        help="KV cache per rank in GiB (env VLLM_CPU_KVCACHE_SPACE, default 4)",
    )
    parser.add_argument(
        "--kv-cache-fraction",
        type=_positive(float),
        help="as for serve: share of each rank's available node memory for the KV cache",
    )
    parser.add_argument("--kernels", choices=("auto", "native", "torch"), default="auto")
    parser.add_argument("--collective", choices=("shm", "gloo"), default="shm")
    parser.add_argument(
        "--bind", help="auto, nobind or CPU lists like 0-31|32-63 (env VLLM_CPU_OMP_THREADS_BIND)"
    )
    parser.add_argument(
        "--reserved-cpus",
        type=int,
        help="cores per rank kept for the frontend (env VLLM_CPU_NUM_OF_RESERVED_CPU)",
    )
    # testing aids: discovery on fabricated sysfs/procfs/cgroupfs trees
    parser.add_argument("--sysfs-root", type=Path, default=Path("/sys"), help=argparse.SUPPRESS)
    parser.add_argument("--proc-root", type=Path, default=Path("/proc"), help=argparse.SUPPRESS)
    parser.add_argument("--cgroup-root", type=Path, help=argparse.SUPPRESS)


def inputs_from_args(args: argparse.Namespace) -> DoctorInputs:
    """The inputs to check; ConfigError (exit 2) where the arguments name nothing usable."""
    from cpud.config import EngineArgs, engine_kwargs
    from cpud.doctor.inputs import DoctorInputs
    from cpud.model.cpu_features import parse_dtype
    from cpud.model_dir import resolve_model_dir

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
    )
