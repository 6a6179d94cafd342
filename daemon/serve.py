"""`cpud serve` in one process (tp=1): HTTP comes up first (/health says 503 while loading),
the engine loads, then requests are served. SIGTERM/SIGINT drain: no new requests, in-flight
ones finish up to the drain timeout, then the process exits 0."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig

from cpud.config import EngineArgs, resolve_config
from cpud.engine.executor import make_executor
from cpud.engine.llm_engine import LLMEngine
from cpud.frontend.app import create_app
from cpud.frontend.async_engine import AsyncEngine
from cpud.frontend.state import Phase, ServerConfig, ServerState
from cpud.llm import resolve_model_dir
from cpud.tokenizer import Tokenizer

log = logging.getLogger("cpud.serve")
EXIT_ENGINE_FAILED = 3


@dataclass(frozen=True)
class ServeArgs:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_names: tuple[str, ...] = ()
    drain_timeout: float = 30.0
    max_waiting: int = 1024
    metrics_need_key: bool = False


def build_engine(args: EngineArgs, model_dir: Path, max_waiting: int) -> AsyncEngine:
    config = resolve_config(args, model_dir)
    tokenizer = Tokenizer(model_dir)
    executor = make_executor(config, args.bind, args.reserved_cpus)
    return AsyncEngine(LLMEngine(config, tokenizer, executor), max_waiting)


async def run_server(engine_args: EngineArgs, serve_args: ServeArgs) -> int:
    model_dir = resolve_model_dir(engine_args.model)
    names = serve_args.served_model_names or (str(engine_args.model or "cpud-default"),)
    probe = resolve_config(engine_args, model_dir)  # fail fast, before binding the port
    state = ServerState(
        ServerConfig(
            served_model_names=names,
            max_model_len=probe.max_model_len,
            api_key=serve_args.api_key,
            metrics_need_key=serve_args.metrics_need_key,
        ),
        Tokenizer(model_dir),
    )
    hyper = HypercornConfig()
    hyper.bind = [f"{serve_args.host}:{serve_args.port}"]
    hyper.accesslog = None
    hyper.graceful_timeout = 5.0
    # Longer than the idle timeout of common clients and load balancers (60 s), so the server
    # is never the side that closes a pooled connection just as a request goes out on it.
    hyper.keep_alive_timeout = 75.0
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    async def drain() -> None:
        if state.phase is Phase.DRAINING:
            return
        state.phase = Phase.DRAINING
        deadline = time.monotonic() + serve_args.drain_timeout
        while state.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if state.in_flight:
            log.warning("drain timeout: %d requests still running", state.in_flight)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(drain()))
    server = asyncio.ensure_future(
        hypercorn_serve(create_app(state), hyper, shutdown_trigger=stop.wait)
    )
    started = time.monotonic()
    try:
        engine = await asyncio.to_thread(
            build_engine, engine_args, model_dir, serve_args.max_waiting
        )
    except BaseException:
        stop.set()
        await server
        raise
    state.attach(engine)

    async def watch_engine() -> None:
        # A dead engine (a rank died) has already failed its requests: exit non-zero so the
        # service manager restarts the daemon with fresh ranks.
        while not stop.is_set():
            if not engine.alive:
                log.error("engine stopped (%s): exiting for a restart", engine.error)
                failed.set()
                stop.set()
                return
            await asyncio.sleep(0.2)

    failed = asyncio.Event()
    watcher = asyncio.ensure_future(watch_engine())
    log.info(
        "ready in %.1f s: serving %s on http://%s:%d",
        time.monotonic() - started,
        names[0],
        serve_args.host,
        serve_args.port,
    )
    await server
    watcher.cancel()
    engine.shutdown()
    return EXIT_ENGINE_FAILED if failed.is_set() else 0


def serve(engine_args: EngineArgs, serve_args: ServeArgs) -> int:
    import uvloop

    return uvloop.run(run_server(engine_args, serve_args))
