"""The frontend process of `cpud serve`: HTTP comes up first (/health says 503 while the ranks
load), the engine attaches when the supervisor reports every rank ready, then requests are
served. SIGTERM/SIGINT drain: no new requests, in-flight ones finish up to the drain timeout,
then the process exits 0. When a rank is lost the engine fails every in-flight request with an
error and the process exits EXIT_CHILD_LOST for the supervisor.

    python -m cpud.frontend.server SPEC_JSON PARENT_PID  < FrontendSecrets as JSON

It dies with PARENT_PID, the supervisor, armed before any heavy import (this module imports
only light ones at its top). Secrets (the API key) come on stdin: never in the spec file, the
command line or the environment.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import msgspec

from cpud.process.parent_death import die_with_parent
from cpud.protocol.launch import FrontendSecrets, FrontendSpec, TokenizerFacts
from cpud.settings.errors import CpudError

if TYPE_CHECKING:
    from cpud.engine.kv_events import ZmqEventPublisher
    from cpud.frontend.http_versions import ServerHttpConfig
    from cpud.settings.config import EngineArgs, EngineConfig, ServeArgs

log = logging.getLogger("cpud.frontend")
EXIT_CONFIG = 2
EXIT_CHILD_LOST = 3


def frontend_spec(
    runtime_dir: str,
    config: EngineConfig,
    engine_args: EngineArgs,
    serve_args: ServeArgs,
    tokenizer: TokenizerFacts | None = None,
) -> FrontendSpec[ServeArgs]:
    """The frontend's spec: the resolved config, the tokenizer (the supervisor's: the frontend
    then reads no model file), and the settings only the frontend reads."""
    from cpud.model.default_model import DEFAULT_MODEL_NAME

    public = dataclasses.replace(serve_args, api_key=None)
    return FrontendSpec(
        runtime_dir=runtime_dir,
        engine=config.spec(),
        model_name=str(engine_args.model or DEFAULT_MODEL_NAME),
        serve_args=public,
        chat_template=engine_args.chat_template,
        tool_call_parser=engine_args.tool_call_parser,
        reasoning_parser=engine_args.reasoning_parser,
        tokenizer=tokenizer,
    )


def send_secrets(stdin: BinaryIO, serve_args: ServeArgs) -> None:
    """Hands the frontend its secrets through the pipe on its stdin, then closes it."""
    try:
        stdin.write(msgspec.json.encode(FrontendSecrets(serve_args.api_key)))
        stdin.close()
    except BrokenPipeError:
        pass  # it exited already; its exit code tells why


def hypercorn_config(serve_args: ServeArgs) -> ServerHttpConfig:
    from cpud.frontend.http_versions import Http2Policy, ServerHttpConfig

    hyper = ServerHttpConfig()
    hyper.bind = [f"{serve_args.host}:{serve_args.port}"]
    hyper.http2 = Http2Policy(enabled=serve_args.http2)
    hyper.alpn_protocols = ["h2", "http/1.1"] if serve_args.http2 else ["http/1.1"]
    hyper.accesslog = None  # cpud.access logs each request (access_log.py)
    # The root handler prints hypercorn's lines; its default "-" would add a second handler.
    hyper.errorlog = logging.getLogger("hypercorn.error")
    hyper.graceful_timeout = 5.0
    # Longer than the idle timeout of common clients and load balancers (60 s), so the server
    # is never the side that closes a pooled connection just as a request goes out on it.
    hyper.keep_alive_timeout = 75.0
    return hyper


def api_key_line(api_key: str | None, metrics_need_key: bool) -> str:
    """Whether clients need the API key (never the key)."""
    if not api_key:
        return "API key off: every client that reaches the port may use the API"
    free = "/health, /version" + ("" if metrics_need_key else ", /metrics")
    return f"API key on: every path but {free} needs Authorization: Bearer <key>"


async def run_frontend(spec: FrontendSpec[ServeArgs], secrets: FrontendSecrets) -> int:
    import asyncio

    import zmq

    from cpud.engine.llm_engine import LLMEngine, end_token_ids
    from cpud.engine.rank_client import RankClient
    from cpud.frontend.app import create_app
    from cpud.frontend.async_engine import AsyncEngine
    from cpud.frontend.http_versions import serve as serve_http
    from cpud.frontend.state import Phase, ServerConfig, ServerState
    from cpud.frontend.stopping import drain as drain_requests
    from cpud.frontend.stopping import fail
    from cpud.frontend.supervisor_link import SupervisorLink
    from cpud.protocol.supervision import HEARTBEAT_INTERVAL_S
    from cpud.settings.config import config_from_spec
    from cpud.structured.compiler import GrammarCompiler
    from cpud.text.tokenizer import Tokenizer

    serve_args = dataclasses.replace(spec.serve_args, api_key=secrets.api_key)
    config = config_from_spec(spec.engine)  # resolved by the supervisor, not again here
    names = serve_args.served_model_names or (spec.model_name,)
    if spec.tokenizer is not None:
        tokenizer = Tokenizer.from_facts(spec.tokenizer)
    else:
        tokenizer = Tokenizer(config.model_dir, spec.chat_template)
    # llguidance's view of the tokenizer is built while the ranks load, not once they are ready.
    grammars = GrammarCompiler(tokenizer, end_token_ids(config, tokenizer), serve_args.grammar)
    grammars.prepare_in_background()
    state = ServerState(
        ServerConfig(
            served_model_names=names,
            max_model_len=config.max_model_len,
            api_key=serve_args.api_key,
            metrics_need_key=serve_args.metrics_need_key,
            stall_seconds=serve_args.stall_timeout,
            tool_call_parser=spec.tool_call_parser,
            reasoning_parser=spec.reasoning_parser,
            prompt_tokens_details=serve_args.enable_prompt_tokens_details,
            replica=serve_args.replica,
        ),
        tokenizer,
    )
    kv_events = kv_event_publisher(serve_args)  # bound now: a taken port stops the start
    ctx = zmq.Context()
    link = SupervisorLink(ctx, spec.runtime_dir)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    address = f"http://{serve_args.host}:{serve_args.port}"

    async def drain() -> None:
        if state.phase is Phase.DRAINING:
            return
        await drain_requests(state, engine, serve_args.drain_timeout)
        stop.set()

    async def heartbeat() -> None:
        # From the event loop itself: a wedged loop stops the heartbeat.
        while True:
            link.heartbeat()
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    log.info("%s", api_key_line(state.config.api_key, serve_args.metrics_need_key))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(drain()))
    engine: AsyncEngine | None = None
    beats = asyncio.ensure_future(heartbeat())
    server = asyncio.ensure_future(
        serve_http(create_app(state, serve_args.cors), hypercorn_config(serve_args), stop.wait)
    )
    try:
        while (ranks := link.ranks_ready()) is None:
            if link.down is not None:
                log.error("not serving: %s", link.down.reason)
                return EXIT_CHILD_LOST
            if server.done() and not stop.is_set():
                exc = server.exception()
                log.error("cannot listen on %s:%d: %s", serve_args.host, serve_args.port, exc)
                return EXIT_CONFIG
            if stop.is_set():
                await server
                return 0
            await asyncio.sleep(0.05)
        blocks = {r.num_kv_blocks for r in ranks.ranks}
        if blocks != {config.num_kv_blocks}:
            log.error("ranks hold %s KV blocks, expected %d", blocks, config.num_kv_blocks)
            return EXIT_CHILD_LOST
        client = RankClient(
            ctx,
            spec.runtime_dir,
            config.tp,
            link.liveness,
            # The supervisor names a hung rank first; this only ends a wait it missed.
            serve_args.step_timeout + 30,
        )
        llm = LLMEngine(config, tokenizer, client, grammars)
        if kv_events is not None:
            llm.blocks.publish_to(kv_events.recorder)
            kv_events.start()
        engine = AsyncEngine(
            llm,
            serve_args.max_waiting,
            rank_pids=[rank.pid for rank in ranks.ranks],
        )
        state.attach(engine)
        link.serving(address)
        failed = False
        while not server.done():
            if not engine.alive and not failed:
                failed = True
                await fail(state, engine)
                stop.set()
            await asyncio.sleep(0.1)
        return EXIT_CHILD_LOST if failed else 0
    finally:
        stop.set()
        if not server.done():
            await server
        beats.cancel()
        if engine is not None:
            engine.shutdown()
        if kv_events is not None:
            kv_events.shutdown()
        link.close()
        ctx.term()
        state.close()


def kv_event_publisher(serve_args: ServeArgs) -> ZmqEventPublisher | None:
    """The KV-cache event publisher --kv-events-config asks for (this replica's endpoint)."""
    if not serve_args.kv_events.enabled:
        return None
    from cpud.engine.kv_events import KVEventRecorder, ZmqEventPublisher

    replica = serve_args.replica or 0
    config = serve_args.kv_events.for_replica(replica)
    return ZmqEventPublisher(config, KVEventRecorder(config.max_queue_size), replica)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    die_with_parent(int(args[1]))
    secrets = msgspec.json.decode(sys.stdin.buffer.read(), type=FrontendSecrets)
    import uvloop

    from cpud.process.log_setup import configure_logging

    configure_logging()
    from cpud.settings.config import ServeArgs

    spec = msgspec.json.decode(Path(args[0]).read_bytes(), type=FrontendSpec[ServeArgs])
    try:
        code = uvloop.run(run_frontend(spec, secrets))
    except CpudError as exc:  # the model or settings: a restart would fail the same way
        log.error("not serving: %s", exc)
        code = EXIT_CONFIG
    # The loop has restored SIGTERM's default action; the supervisor may still forward the
    # drain signal it got, and that must not turn this exit into a death by signal.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return code


if __name__ == "__main__":
    sys.exit(main())
