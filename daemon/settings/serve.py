"""The settings of `cpud serve` beyond the engine's: listening, keys, names, admission,
timeouts, grammars, CORS (ServeArgs, GrammarLimits, CorsPolicy)."""

from __future__ import annotations

from cpud.settings.setting import DOCTOR, SERVE, Setting

ONLY_SERVE = frozenset({SERVE})

# What cross-origin requests may use where --allowed-methods / --allowed-headers is unset: any
# method, any header (CorsPolicy's defaults).
CORS_ALLOW_ANY = ("*",)
_ANY_SHOWN = ", ".join(f"`{word}`" for word in CORS_ALLOW_ANY)


def _serve(name: str, kind: type, default: object, help: str, flag: str, **more) -> Setting:
    return Setting(name, kind, default, help, ONLY_SERVE, flags=(flag,), **more)


SERVE_SETTINGS = (
    _serve("host", str, "127.0.0.1", "address to listen on", "--host"),
    _serve("port", int, 8000, "TCP port of the OpenAI API", "--port"),
    _serve(
        "api_key",
        str,
        None,
        "require `Authorization: Bearer KEY`; on the command line every user sees it in the "
        "process list: prefer --api-key-file or the environment",
        "--api-key",
        env_aliases=("VLLM_API_KEY",),
        metavar="KEY",
        note_given=True,
        shown_default="none",
        details="`Authorization: Bearer KEY` (or `x-api-key: KEY`, as Anthropic's clients send "
        "it) required on every route except /health (and /metrics unless "
        "`--metrics-need-key`). On the command line every user of the machine sees the key in "
        "the process list (cpud warns): prefer the file below or the environment. The daemon "
        "passes the key to its frontend through a pipe; it is in no file, command line or "
        "child environment",
    ),
    _serve(
        "api_key_file",
        str,
        None,
        "read the API key from PATH (one line; keep the file 0600 or 0640)",
        "--api-key-file",
        metavar="PATH",
        note_given=True,
        shown_default="none",
        details="the same key read from a file: one line, one trailing newline dropped. A "
        "missing or empty file, or one holding more than one line, stops the daemon with exit "
        "2; a file every user may read gets a warning (keep it 0600, or use a systemd "
        "credential). Give the key one way: two at once are an error. The path must name a "
        "regular file: a FIFO, device or directory is exit 2",
    ),
    _serve(
        "metrics_need_key",
        bool,
        False,
        "also require the API key for /metrics",
        "--metrics-need-key",
    ),
    _serve(
        "allowed_origins",
        str,
        None,
        "browser origins that may call the API (CORS), e.g. http://localhost:3000, or *; as "
        "words, commas or a JSON list. Default: none, and no preflight is answered",
        "--allowed-origins",
        metavar="ORIGIN",
        many=True,
        shown_default="none",
        details="browser origins (`scheme://host[:port]`, or `*`) that may call the API from a "
        "web page (CORS), as vLLM's flag: separate words, commas, or a JSON list. Listed "
        "origins get preflights answered (before the API key check: a preflight carries no "
        "key) and `Access-Control-Allow-Origin` on answers, with `X-Request-Id` exposed; the "
        "calls still need the key. None (the default): no preflight is answered. An entry with "
        "a path or trailing slash is exit 2",
    ),
    _serve(
        "allowed_methods",
        str,
        None,
        "methods cross-origin requests may use, with --allowed-origins (default: *)",
        "--allowed-methods",
        metavar="METHOD",
        many=True,
        shown_default=_ANY_SHOWN,
    ),
    _serve(
        "allowed_headers",
        str,
        None,
        "request headers cross-origin requests may send, with --allowed-origins (default: *)",
        "--allowed-headers",
        metavar="HEADER",
        many=True,
        shown_default=_ANY_SHOWN,
    ),
    _serve(
        "enable_prompt_tokens_details",
        bool,
        True,
        "report usage.prompt_tokens_details.cached_tokens, the prompt tokens the prefix cache "
        "served (on by default); --no-enable-prompt-tokens-details leaves it out so that no "
        "client learns from it what others sent (send cache_salt for that too)",
        "--enable-prompt-tokens-details",
        details="report `usage.prompt_tokens_details.cached_tokens`, the prompt tokens the "
        "prefix cache served (vLLM's flag). Off: chat and completion usage leave it out and "
        "/v1/responses reports `cached_tokens: 0`, so no client learns from it what another "
        "sent (tenants should also send `cache_salt`: time to first token still tells a hit "
        "from a miss)",
    ),
    _serve(
        "http2",
        bool,
        False,
        "also speak cleartext HTTP/2 (prior knowledge or an h2c upgrade); a connection that "
        "resets more than 100 streams within 10 s is closed",
        "--http2",
        details="also speak cleartext HTTP/2 on the port: with prior knowledge, or after an "
        "`Upgrade: h2c` request. A connection whose client resets more than 100 streams within "
        "10 s is closed with GOAWAY ENHANCE_YOUR_CALM, and a stream opened and reset within one "
        'read starts no request (HTTP/2 "rapid reset"). Off, a prior-knowledge preface gets a '
        "505 naming the flag and a closed connection, and an `Upgrade: h2c` request is answered "
        "in HTTP/1.1",
    ),
    _serve(
        "grammar_compile_timeout",
        float,
        10.0,
        "seconds a constrained request waits for its grammar (compile and first mask, queueing "
        "included); too slow is a 400, compile threads busy with others a 429",
        "--grammar-compile-timeout",
        metavar="SECONDS",
        details="seconds a constrained request waits for its grammar (compile, first mask and "
        "first token, queueing included): too slow to compile is a 400, compile threads busy "
        "with others' grammars a 429 with Retry-After",
    ),
    _serve(
        "grammar_compile_threads",
        int,
        2,
        "output grammars compiled at once, each on a thread of lowered CPU priority",
        "--grammar-compile-threads",
        details="output grammars compiled at once, each on a thread of lowered CPU priority "
        "(nice 10), never on the engine thread",
    ),
    _serve(
        "grammar_cache_mib",
        int,
        128,
        "memory the compiled-grammar cache may hold (estimated); bigger grammars are not kept",
        "--grammar-cache-mib",
        metavar="MIB",
        details="memory the compiled-grammar cache may hold (estimated per entry); a grammar "
        "over an eighth of it is not kept",
    ),
    _serve(
        "served_model_names",
        str,
        None,
        "model names clients use (default: --model)",
        "--served-model-name",
        metavar="NAME",
        many=True,
        shown_default="the `--model` value",
        details="names clients use; the environment takes a comma- or space-separated list",
    ),
    _serve(
        "max_waiting",
        int,
        1024,
        "requests admitted at once (running + queued); more get 429 with Retry-After",
        "--max-pending-requests",
    ),
    _serve(
        "drain_timeout",
        float,
        30.0,
        "seconds in-flight requests may take to finish after SIGTERM",
        "--drain-timeout",
    ),
    _serve(
        "ready_timeout",
        float,
        600.0,
        "seconds the ranks may take to bind, pin and load their weights",
        "--ready-timeout",
    ),
    _serve(
        "rank_timeout",
        float,
        30.0,
        "seconds a rank or the frontend may go without a heartbeat before the daemon counts it "
        "as lost and exits 3 for a restart",
        "--rank-timeout",
    ),
    _serve(
        "step_timeout",
        float,
        300.0,
        "seconds one model step may run before its rank counts as hung",
        "--step-timeout",
    ),
    _serve(
        "stall_timeout",
        float,
        10.0,
        "seconds queued work may wait for a step to finish before /health answers 503",
        "--stall-timeout",
        details="seconds queued work may wait for a step to finish before `/health` answers 503 "
        "`stalled` (a stopped or starved rank), long before `--step-timeout` ends it; keep it "
        "above your slowest prefill step",
    ),
    Setting(
        "data_parallel_size",
        int,
        1,
        "replicas, each a frontend and --tp ranks of its own, placed one per NUMA node group; "
        "on ports --port, --port + 1, ... (behind --router: on loopback ports above --port)",
        frozenset({SERVE, DOCTOR}),
        flags=("--data-parallel-size", "-dp"),
        metavar="N",
        positive=True,
        details="replicas on this host (vLLM's flag), each a frontend with --tp ranks of its "
        "own, placed by the binding plan: N x tp ranks over the usable NUMA nodes, so by "
        "default one replica per node group; on fewer nodes than replicas the nodes' cores are "
        "split evenly, with a warning. Replica i serves on --port + i; with --router the router "
        "takes --port and the replicas 127.0.0.1:--port + 1 + i. A replica whose rank or "
        "frontend is lost restarts on its own while the others serve; each replica's metrics "
        "carry a `replica` label",
    ),
    Setting(
        "data_parallel_rank",
        int,
        None,
        "this server is replica N of several started on their own (cpud@N units): its metrics "
        'carry replica="N", its logs [replica N], its KV events the endpoint\'s port + N',
        ONLY_SERVE,
        flags=("--data-parallel-rank", "-dpr"),
        metavar="N",
        details="vLLM's flag for replicas started one by one (deploy/cpud@.service passes "
        '`CPUD_DATA_PARALLEL_RANK=%i`): the server\'s metrics carry `replica="N"` and its '
        "supervisor, frontend and ranks log as `[replica N]`, as `--data-parallel-size` labels "
        "its own replicas; with --kv-events-config it binds the endpoints' ports + N. Not with "
        "--data-parallel-size above 1",
    ),
    _serve(
        "router",
        bool,
        False,
        "start vllm-router (pip install vllm-router) on --port in front of the replicas",
        "--router",
        details="start vLLM's router (`vllm-router`, an optional dependency) on --host:--port "
        "in front of the --data-parallel-size replicas, supervised like the replicas (restarted "
        "when it exits); its policy defaults to cache_aware, its metrics go to 127.0.0.1 on "
        "--port + N + 1. With --kv-events-config, every replica's publisher is one of the "
        "router's KV event sources (for `--router-args '--policy kv_aware'`)",
    ),
    _serve(
        "router_args",
        str,
        None,
        "more vllm-router flags, as one shell-quoted string (e.g. '--policy round_robin')",
        "--router-args",
        metavar="ARGS",
        shown_default="none",
    ),
    _serve(
        "kv_events_config",
        str,
        None,
        "publish KV-cache events as vLLM does, for vllm-router's kv_aware policy: vLLM's JSON, "
        'e.g. \'{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557"}\'',
        "--kv-events-config",
        metavar="JSON",
        shown_default="none (off)",
        details="vLLM's KVEventsConfig as JSON: `enable_kv_cache_events`, `publisher` (`zmq` or "
        "`null`), `endpoint` (default `tcp://127.0.0.1:5557`; cpud binds it), `replay_endpoint`, "
        "`buffer_steps`, `hwm`, `max_queue_size`, `topic`. Each batch is vLLM's msgpack "
        "`[ts, events, replica]` on a ZeroMQ PUB socket: BlockStored when a full block enters the "
        "prefix cache, BlockRemoved when a cached block is reused, AllBlocksCleared at start. "
        "With --data-parallel-size, replica i binds the endpoint's port + i. Point vllm-router at "
        "it with `--policy kv_aware --kv-event-source URL=tcp://HOST:PORT --kv-event-model NAME "
        "--kv-event-block-size` (cpud's --block-size)",
    ),
)
