"""`cpud` command line: serve (default), generate, model make."""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import time
from collections.abc import Sequence

from cpud.errors import CpudError
from cpud.serve_flags import add_serve_flags

SUPPRESS = argparse.SUPPRESS

EXIT_CONFIG = 2
MAX_API_KEY_BYTES = 4096


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="Hugging Face model directory (default: embedded fixture)")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="bfloat16, float16, float32 or auto (bf16 where the CPU has AVX512-BF16/AMX)",
    )
    parser.add_argument(
        "--tp",
        "--tensor-parallel-size",
        dest="tp",
        type=int,
        default=1,
        help="rank processes, each with one weight shard; --bind auto puts one per NUMA node",
    )
    parser.add_argument("--max-model-len", type=int, help="context length in tokens")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    parser.add_argument(
        "--max-num-seqs", type=int, default=256, help="sequences computed together in one step"
    )
    parser.add_argument(
        "--max-num-batched-tokens", type=int, help="token budget of one step (default 2048)"
    )
    parser.add_argument(
        "--kv-cache-space",
        type=float,
        help="KV cache size per rank in GiB of host RAM (default 4, capped at what --max-num-seqs "
        "full-length sequences can use)",
    )
    parser.add_argument(
        "--kv-cache-fraction",
        type=float,
        help="KV cache as a share (0-1] of each rank's available NUMA-node memory after weights "
        "and runtime; used when --kv-cache-space is not given",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="vLLM's name, accepted for compatibility: on CPU it means --kv-cache-fraction "
        "(a share of host RAM, not GPU memory)",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse KV blocks of identical prompt prefixes",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of requests without their own")
    parser.add_argument(
        "--bind",
        help="CPUs per rank: auto (one rank per NUMA node, one thread per physical core), "
        "nobind, or lists like 0-31|32-63 (env VLLM_CPU_OMP_THREADS_BIND)",
    )
    parser.add_argument(
        "--reserved-cpus",
        type=int,
        help="cores per rank kept for the frontend (env VLLM_CPU_NUM_OF_RESERVED_CPU)",
    )
    parser.add_argument(
        "--collective",
        choices=("shm", "gloo"),
        default="shm",
        help="all-reduce between ranks: shared memory (default) or torch gloo",
    )
    parser.add_argument(
        "--kernels",
        choices=("auto", "native", "torch"),
        default="auto",
        help="native SIMD kernels (auto: when built) or the torch reference path",
    )
    parser.add_argument(
        "--weight-cache",
        default="auto",
        metavar="DIR|auto|off",
        help="keep each rank's packed weights in DIR so later starts map them instead of "
        "reading and packing the checkpoint (auto: $CPUD_CACHE_DIR/packed, else "
        "~/.cache/cpud/packed; off: never)",
    )
    parser.add_argument(
        "--kv-cache-pretouch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after the load, map each rank's KV cache pages whenever the rank has run no step "
        "for 0.25 s, so requests do not pay for fresh pages; --no-kv-cache-pretouch leaves "
        "them to fault on use",
    )
    parser.add_argument(
        "--quantization",
        "-q",
        default="auto",
        choices=("auto", "none", "q8_0", "q4_0", "q4_k"),
        help="auto: a GGUF file's Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K linears stay in their blocks and "
        "run the int8 kernels (activations rounded to int8 per 32 values), dense checkpoints "
        "run dense; none: dequantize GGUF blocks to --dtype at load; q8_0|q4_0|q4_k: quantize "
        "a dense checkpoint at load into that llama.cpp block type (LM head and embedding "
        "Q8_0), kept in --weight-cache",
    )
    parser.add_argument(
        "--int8-kernels",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="deprecated: --int8-kernels is --quantization auto, --no-int8-kernels is none",
    )


def _kv_fraction(args: argparse.Namespace) -> float | None:
    from cpud.errors import ConfigError

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
    from cpud.config import engine_kwargs, int8_kernels_quantization

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


def read_api_key_file(path: str) -> str:
    """The API key in `path`: one line, one trailing newline dropped. ConfigError for a file
    that cannot be read, is empty or holds more than a key; a warning when every user may read
    it."""
    from cpud.errors import ConfigError
    from cpud.user_files import open_regular

    try:
        with open_regular(path, "--api-key-file ") as file:
            mode = os.fstat(file.fileno()).st_mode
            raw = file.read(MAX_API_KEY_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"--api-key-file {path}: {exc.strerror}") from None
    if len(raw) > MAX_API_KEY_BYTES:
        raise ConfigError(f"--api-key-file {path} is over {MAX_API_KEY_BYTES} bytes: not a key")
    try:
        key = raw.decode().removesuffix("\n").removesuffix("\r")
    except UnicodeDecodeError:
        raise ConfigError(f"--api-key-file {path} is not UTF-8 text") from None
    if not key:
        raise ConfigError(f"--api-key-file {path} is empty: write the key into it")
    if key != key.strip() or any(ord(c) < 32 or ord(c) == 127 for c in key):
        raise ConfigError(
            f"--api-key-file {path} must hold the key alone on one line, without spaces or "
            "control characters around or in it"
        )
    if stat.S_ISREG(mode) and mode & stat.S_IROTH:
        print(
            f"cpud: warning: --api-key-file {path} is readable by every user "
            f"(mode {stat.S_IMODE(mode):04o}): chmod o-r it",
            file=sys.stderr,
        )
    return key


def _api_key(args: argparse.Namespace) -> str | None:
    """From --api-key-file, --api-key or the environment: a flag beats the environment; two
    sources at the same level are an error."""
    from cpud import envs
    from cpud.errors import ConfigError

    given = {"api_key", "api_key_file"} & args.given
    if len(given) == 2:
        raise ConfigError("--api-key and --api-key-file both give the API key: give one")
    if given == {"api_key"}:
        print(
            "cpud: warning: --api-key shows the key to every user of this machine in the "
            "process list; use --api-key-file or the CPUD_API_KEY environment variable",
            file=sys.stderr,
        )
        return args.api_key
    if not given and args.api_key and args.api_key_file:
        raise ConfigError(
            "CPUD_API_KEY_FILE and an API key variable (CPUD_API_KEY, VLLM_API_KEY) are both "
            "set: set one"
        )
    if args.api_key_file:
        return read_api_key_file(args.api_key_file)
    return args.api_key or envs.api_key()


def cmd_serve(args: argparse.Namespace) -> int:
    from cpud.config import EngineArgs, ServeArgs
    from cpud.cors_policy import CorsPolicy, word_list
    from cpud.log_setup import configure_logging
    from cpud.structured.limits import GrammarLimits
    from cpud.supervisor import serve

    configure_logging()
    engine_args = EngineArgs(model=args.model, **_engine_kwargs(args))
    serve_args = ServeArgs(
        host=args.host,
        port=args.port,
        api_key=_api_key(args),
        served_model_names=tuple(args.served_model_name or ()),
        drain_timeout=args.drain_timeout,
        metrics_need_key=args.metrics_need_key,
        max_waiting=args.max_pending_requests,
        ready_timeout=args.ready_timeout,
        rank_timeout=args.rank_timeout,
        step_timeout=args.step_timeout,
        stall_timeout=args.stall_timeout,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        http2=args.http2,
        grammar=GrammarLimits(
            compile_timeout=args.grammar_compile_timeout,
            compile_threads=args.grammar_compile_threads,
            cache_mib=args.grammar_cache_mib,
        ),
        cors=CorsPolicy(
            origins=word_list(args.allowed_origins),
            methods=word_list(args.allowed_methods) or ("*",),
            headers=word_list(args.allowed_headers) or ("*",),
        ),
    )
    return serve(engine_args, serve_args)


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
    _add_engine_flags(srv)
    add_serve_flags(srv)
    srv.set_defaults(func=cmd_serve, given=frozenset())
    _document_env(srv)

    gen = sub.add_parser("generate", help="generate text offline (no HTTP)")
    _add_engine_flags(gen)
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


def _flag_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in parser._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction) and a.help is not SUPPRESS
    ]


def _long_flag(action: argparse.Action) -> str:
    return next(o for o in action.option_strings if o.startswith("--"))


def _document_env(sub: argparse.ArgumentParser) -> None:
    """Each flag's help names its environment variables and default (--help is the reference)."""
    from cpud import envs

    for action in _flag_actions(sub):
        names = " or ".join(envs.flag_env_names(_long_flag(action)))
        default = "" if action.default in (None, False) else "; default %(default)s"
        action.help = f"{action.help or ''} [env {names}{default}]".lstrip()


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[name]


def apply_env_defaults(parser: argparse.ArgumentParser, environ: dict[str, str]) -> None:
    """Defaults of `cpud serve` (and `cpud doctor`) flags from the environment (see
    cpud.envs), so a systemd EnvironmentFile or a vLLM deployment's environment configures the
    daemon, and the doctor checks the configuration the daemon would run."""
    for name in ("serve", "doctor"):
        _apply_env_defaults(_subparser(parser, name), environ)


def _apply_env_defaults(sub: argparse.ArgumentParser, environ: dict[str, str]) -> None:
    from cpud import envs

    for action in _flag_actions(sub):
        if action.dest == "json":
            continue
        flag = _long_flag(action)
        for name in envs.flag_env_names(flag):
            raw = environ.get(name, "")
            if not raw.strip():
                continue
            if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
                kind = "bool"
            else:
                kind = "list" if action.nargs == "+" else "value"
            value = envs.parse_env_value(name, raw, flag, kind, action.type, action.choices)
            sub.set_defaults(**{action.dest: value})
            break


def serve_env_vars() -> dict[str, str]:
    """Every environment variable that sets a `cpud serve` flag, mapped to the flag."""
    from cpud import envs

    return {
        name: _long_flag(action)
        for action in _flag_actions(_subparser(build_parser(), "serve"))
        for name in envs.flag_env_names(_long_flag(action))
    }


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
