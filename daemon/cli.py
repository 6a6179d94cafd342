"""`cpud` command line: serve (default), generate, model make."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

from cpud.settings import ENV_COMMANDS, GENERATE, SERVE
from cpud.settings.errors import CpudError
from cpud.settings.flags import add_flags, env_variables
from cpud.settings.flags import apply_env_defaults as settings_env_defaults

EXIT_CONFIG = 2


def _kv_fraction(args: argparse.Namespace) -> float | None:
    from cpud.settings.errors import ConfigError

    if args.gpu_memory_utilization is None:
        return args.kv_cache_fraction
    if args.kv_cache_fraction is not None:
        raise ConfigError(
            "--kv-cache-fraction and --gpu-memory-utilization are the same setting: give one"
        )
    print(
        "cpud: warning: --gpu-memory-utilization is read as --kv-cache-fraction: on CPU it is "
        "the share of host RAM (each rank's NUMA node, after weights) given to the KV cache",
        file=sys.stderr,
    )
    return args.gpu_memory_utilization


def _engine_kwargs(args: argparse.Namespace) -> dict:
    from cpud.settings.config import int8_kernels_quantization
    from cpud.settings.flags import engine_kwargs

    if args.int8_kernels is not None:  # resolve_quantization reads it into quantization
        value = int8_kernels_quantization(args.int8_kernels)
        print(
            f"cpud: warning: --int8-kernels is deprecated; it means --quantization {value}",
            file=sys.stderr,
        )
    return {**engine_kwargs(vars(args)), "kv_cache_fraction": _kv_fraction(args)}


def cmd_generate(args: argparse.Namespace) -> int:
    from cpud import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(args.model, **_engine_kwargs(args))
    loaded = time.perf_counter()
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sample_seed,
        ignore_eos=args.ignore_eos,
    )
    prompts = args.prompt or ["The quick brown fox"]
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - loaded
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    if args.json:
        rows = [
            {
                "prompt": o.prompt,
                "text": o.outputs[0].text,
                "token_ids": o.outputs[0].token_ids,
                "finish_reason": o.outputs[0].finish_reason,
            }
            for o in outputs
        ]
        print(json.dumps({"outputs": rows, "load_seconds": loaded - started}))
    else:
        for output in outputs:
            print(f"{output.prompt!r} -> {output.outputs[0].text!r}")
        print(
            f"model {llm.config.model_dir} ({llm.config.model.architecture}, "
            f"{str(llm.config.dtype).removeprefix('torch.')}): loaded in {loaded - started:.2f} s, "
            f"{generated} tokens in {elapsed:.2f} s ({generated / elapsed:.1f} tok/s)",
            file=sys.stderr,
        )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from cpud.process.log_setup import REPLICA_ENV, configure_logging
    from cpud.settings.config import EngineArgs
    from cpud.settings.serve_flags import serve_args
    from cpud.supervisor import serve

    if args.data_parallel_rank is not None:  # its frontend and ranks, too, log the replica
        os.environ[REPLICA_ENV] = str(args.data_parallel_rank)
    configure_logging()
    engine_args = EngineArgs(model=args.model, **_engine_kwargs(args))
    return serve(engine_args, serve_args(args))


def cmd_doctor(args: argparse.Namespace) -> int:
    from cpud.doctor.run import run_command

    return run_command(args)


def cmd_model_make(args: argparse.Namespace) -> int:
    from cpud.fixtures import make_model

    started = time.perf_counter()
    path = make_model(
        args.arch,
        args.preset,
        args.outdir,
        seed=args.seed,
        max_shard_bytes=args.max_shard_bytes,
        dtype=args.dtype,
    )
    print(f"wrote {args.arch}/{args.preset} to {path} in {time.perf_counter() - started:.1f} s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from cpud.fixtures import ALL_ARCHS, ALL_PRESETS

    parser = argparse.ArgumentParser(prog="cpud", description="CPU-native LLM serving daemon")
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible API (the default command)")
    add_flags(srv, SERVE)
    srv.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="generate text offline (no HTTP)")
    add_flags(gen, GENERATE)
    gen.add_argument("prompt", nargs="*", help="prompts (default: one sample prompt)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sample-seed", type=int, help="per-request sampling seed")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="print outputs as JSON")
    gen.set_defaults(func=cmd_generate)

    from cpud.doctor.args import EPILOG, add_doctor_arguments

    doctor = sub.add_parser(
        "doctor",
        help="what cpud will do on this machine (CPUs, NUMA, cgroup, binding, memory) and "
        "what to change",
        epilog=EPILOG,
    )
    add_doctor_arguments(doctor)
    doctor.set_defaults(func=cmd_doctor)

    model = sub.add_parser("model", help="model utilities")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    make = model_sub.add_parser("make", help="write a random-weight fixture model directory")
    make.add_argument("--arch", required=True, choices=ALL_ARCHS)
    make.add_argument("--preset", default="tiny", choices=ALL_PRESETS)
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--max-shard-bytes", type=int, help="split weights into shards this big")
    make.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    make.add_argument("outdir")
    make.set_defaults(func=cmd_model_make)
    return parser


COMMANDS = ("serve", "generate", "doctor", "model", "-h", "--help")


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[name]


def apply_env_defaults(parser: argparse.ArgumentParser, environ: dict[str, str]) -> None:
    """Defaults of `cpud serve` (and `cpud doctor`) flags from the environment (see
    cpud.settings), so a systemd EnvironmentFile or a vLLM deployment's environment configures
    the daemon, and the doctor checks the configuration the daemon would run."""
    for name in ENV_COMMANDS:
        settings_env_defaults(_subparser(parser, name), name, environ)


def serve_env_vars() -> dict[str, str]:
    """Every environment variable that sets a `cpud serve` flag, mapped to the flag."""
    return env_variables(SERVE)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        argv.insert(0, "serve")  # `cpud --tp 2 --bind auto` serves
    parser = build_parser()
    try:
        apply_env_defaults(parser, dict(os.environ))
    except CpudError as exc:
        print(f"cpud: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except CpudError as exc:
        print(f"cpud: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
