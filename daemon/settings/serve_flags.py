"""ServeArgs from the parsed flags of `cpud serve` (declared in cpud.settings): the API key from
its flag, its file or the environment, and the grammar and CORS settings grouped."""

from __future__ import annotations

import argparse
import os
import stat
import sys

from cpud.settings import CORS_ALLOW_ANY
from cpud.settings.config import ServeArgs

MAX_API_KEY_BYTES = 4096


def serve_args(args: argparse.Namespace) -> ServeArgs:
    """The serve settings of a parsed `cpud serve` command line; ConfigError for a bad one."""
    from cpud.settings.cors_policy import CorsPolicy, word_list
    from cpud.settings.kv_events_config import KVEventsConfig
    from cpud.structured.limits import GrammarLimits

    return ServeArgs(
        host=args.host,
        port=args.port,
        api_key=api_key(args),
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
        data_parallel_size=args.data_parallel_size,
        router=args.router,
        router_args=args.router_args,
        kv_events=KVEventsConfig.parse(args.kv_events_config),
        replica=data_parallel_rank(args),
        grammar=GrammarLimits(
            compile_timeout=args.grammar_compile_timeout,
            compile_threads=args.grammar_compile_threads,
            cache_mib=args.grammar_cache_mib,
        ),
        cors=CorsPolicy(
            origins=word_list(args.allowed_origins),
            methods=word_list(args.allowed_methods) or CORS_ALLOW_ANY,
            headers=word_list(args.allowed_headers) or CORS_ALLOW_ANY,
        ),
    )


def data_parallel_rank(args: argparse.Namespace) -> int | None:
    """The replica index --data-parallel-rank gives this server; ConfigError for a negative one
    or one beside --data-parallel-size N, whose replicas are numbered by cpud."""
    from cpud.settings.errors import ConfigError

    rank = args.data_parallel_rank
    if rank is None:
        return None
    if rank < 0:
        raise ConfigError(f"--data-parallel-rank must be 0 or more, got {rank}")
    if args.data_parallel_size > 1:
        raise ConfigError(
            "--data-parallel-rank names one replica started on its own; --data-parallel-size "
            f"{args.data_parallel_size} starts and numbers its replicas itself: give only one"
        )
    return rank


def read_api_key_file(path: str) -> str:
    """The API key in `path`: one line, one trailing newline dropped. ConfigError for a file
    that cannot be read, is empty or holds more than a key; a warning when every user may read
    it."""
    from cpud.process.user_files import open_regular
    from cpud.settings.errors import ConfigError

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


def api_key(args: argparse.Namespace) -> str | None:
    """From --api-key-file, --api-key or the environment: a flag beats the environment; two
    sources at the same level are an error."""
    from cpud.settings import envs
    from cpud.settings.errors import ConfigError

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
