"""The flags of `cpud serve` beyond the engine's: listening, keys, names, timeouts, templates."""

from __future__ import annotations

import argparse


class _StoreGiven(argparse.Action):
    """Stores the value and notes that the flag came on the command line (in `given`), which
    an environment default does not."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = {*namespace.given, self.dest}


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="TCP port of the OpenAI API")
    parser.add_argument(
        "--api-key",
        action=_StoreGiven,
        metavar="KEY",
        help="require `Authorization: Bearer KEY`; on the command line every user sees it in the "
        "process list: prefer --api-key-file or the environment",
    )
    parser.add_argument(
        "--api-key-file",
        action=_StoreGiven,
        metavar="PATH",
        help="read the API key from PATH (one line; keep the file 0600 or 0640)",
    )
    parser.add_argument(
        "--served-model-name", nargs="+", help="model names clients use (default: --model)"
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may take to finish after SIGTERM",
    )
    parser.add_argument(
        "--metrics-need-key", action="store_true", help="also require the API key for /metrics"
    )
    parser.add_argument(
        "--max-pending-requests",
        type=int,
        default=1024,
        help="requests admitted at once (running + queued); more get 429 with Retry-After",
    )
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        help="seconds the ranks may take to bind, pin and load their weights",
    )
    parser.add_argument(
        "--rank-timeout",
        type=float,
        default=30.0,
        help="seconds a rank or the frontend may go without a heartbeat before the daemon "
        "counts it as lost and exits 3 for a restart",
    )
    parser.add_argument(
        "--step-timeout",
        type=float,
        default=300.0,
        help="seconds one model step may run before its rank counts as hung",
    )
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=10.0,
        help="seconds queued work may wait for a step to finish before /health answers 503",
    )
    parser.add_argument(
        "--http2",
        action="store_true",
        help="also speak cleartext HTTP/2 (prior knowledge or an h2c upgrade); a connection "
        "that resets more than 100 streams within 10 s is closed",
    )
    parser.add_argument(
        "--enable-prompt-tokens-details",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="report usage.prompt_tokens_details.cached_tokens, the prompt tokens the prefix "
        "cache served (on by default); --no-enable-prompt-tokens-details leaves it out so that "
        "no client learns from it what others sent (send cache_salt for that too)",
    )
    parser.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="seconds a constrained request waits for its grammar (compile and first mask, "
        "queueing included); too slow is a 400, compile threads busy with others a 429",
    )
    parser.add_argument(
        "--grammar-compile-threads",
        type=int,
        default=2,
        help="output grammars compiled at once, each on a thread of lowered CPU priority",
    )
    parser.add_argument(
        "--grammar-cache-mib",
        type=int,
        default=128,
        metavar="MIB",
        help="memory the compiled-grammar cache may hold (estimated); bigger grammars are not kept",
    )
    parser.add_argument(
        "--allowed-origins",
        nargs="+",
        metavar="ORIGIN",
        help="browser origins that may call the API (CORS), e.g. http://localhost:3000, or *; "
        "as words, commas or a JSON list. Default: none, and no preflight is answered",
    )
    parser.add_argument(
        "--allowed-methods",
        nargs="+",
        metavar="METHOD",
        help="methods cross-origin requests may use, with --allowed-origins (default: *)",
    )
    parser.add_argument(
        "--allowed-headers",
        nargs="+",
        metavar="HEADER",
        help="request headers cross-origin requests may send, with --allowed-origins (default: *)",
    )
    parser.add_argument(
        "--chat-template",
        metavar="FILE_OR_STRING",
        help="chat template (jinja) replacing the model's, or for a model without one: a file, "
        "else the template itself (backslash escapes decoded), as vLLM's flag",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=("hermes", "llama3_json", "mistral"),
        help="the format of the model's tool calls, as vLLM names it (default: read from the "
        "chat template, else hermes)",
    )
