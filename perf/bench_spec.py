"""Speculative decoding against plain decoding, and against llama.cpp's server doing the same.

Tasks: `rewrite` (input-grounded: the model rewrites a given document, so most of its output
is in its prompt) and `chat` (short open questions). Methods: `ngram` (prompt lookup) and
`draft` (a draft model with the target's tokenizer: by default the default model's Q4_1 file
drafting for a Q8_0 copy of itself, or the --target-type copy, that perf/requantize_gguf.py
writes once).

Engines, in interleaved rounds (A B C D A B C D ...): cpud without and with
--speculative-config; with --peer, llama-server (b11434, perf/peers/llamacpp_server.py) on
the same GGUF file(s) without and with its speculation at the same k (n-gram: ngram-simple,
one lookup length --peer-ngram-n; draft: draft-simple). Each round decodes `streams` greedy
requests at once (the peer: 1 stream); a stream's prompt differs by its first line. The decode
rate is output tokens after each stream's first, per second from the first token of the round
to its end (llama-server reports the same figure per request in its timings). Medians, the
ratios, and both sides' acceptance counters.

    python perf/bench_spec.py [--task rewrite|chat] [--method ngram|draft] [--model PATH]
        [--draft-model PATH] [--streams 1,32] [--rounds 3] [--k 4] [--peer]

--model: the target (default: the default model for ngram, its Q8_0 copy for draft). A
qwen3-0.6b-shaped fixture: `cpud model make qwen3 --preset qwen3-0.6b DIR` then --model DIR
(random weights: the output is not a rewrite, so this measures the off-switch more than the
gain; no --peer: llama-server needs a GGUF file).

Do not run it beside other work: it is a timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "peers"))

from quiet import wait_until_quiet  # noqa: E402

from cpud import LLM, SamplingParams  # noqa: E402

DOCUMENT = """\
Maintenance notice for the west reading room

The west reading room will close for maintenance from the first to the fifteenth of March.
During this time the heating system will be replaced, the windows along the north wall will
be resealed, and the old oak tables will be sanded and varnished. Books normally shelved in
the west room will be moved to the east gallery, where they can be requested at the main
desk. The quiet study area will move to the second floor, next to the map collection. Staff
will be available at the main desk from nine in the morning until six in the evening to help
readers find what they need. We apologise for the inconvenience and thank all readers for
their patience while the work is carried out.
"""
QUESTIONS = (
    "Explain in a short paragraph why the sky is blue.",
    "Give three tips for keeping a houseplant healthy.",
    "What is the difference between weather and climate?",
    "Describe how a bicycle's gears make climbing hills easier.",
    "Why do we have leap years?",
    "Write a short note inviting a neighbour to a garden party.",
    "How does a refrigerator keep food cold?",
    "What should I pack for a one-day hike?",
)


def messages(stream: int, task: str = "rewrite") -> list[dict]:
    if task == "chat":
        return [{"role": "user", "content": QUESTIONS[stream % len(QUESTIONS)]}]
    document = DOCUMENT.replace("west reading room", f"west reading room {stream + 1}", 1)
    ask = "Rewrite the following notice exactly, keeping every sentence and its wording:"
    return [{"role": "user", "content": f"{ask}\n\n{document}"}]


def prompt_ids(llm: LLM, stream: int, task: str) -> list[int]:
    text = llm.tokenizer.apply_chat_template(messages(stream, task))
    return llm.tokenizer.encode(text, add_special_tokens=False)


def decode_rate(llm: LLM, streams: int, max_tokens: int, task: str = "rewrite") -> float:
    """Output tokens per second after the round's first token, `streams` requests at once."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for stream in range(streams):
        prompt = prompt_ids(llm, stream, task)
        engine.add_request(f"r{time.monotonic_ns()}-{stream}", prompt, params)
    first: float | None = None
    tokens = 0
    while engine.has_unfinished():
        for out in engine.step():
            for choice in out.outputs:
                tokens += len(choice.token_ids)
        if first is None and tokens:
            first, tokens = time.perf_counter(), 0
    ended = time.perf_counter()
    return tokens / (ended - first) if first is not None and ended > first else 0.0


def default_target(method: str, qtype: str) -> str | None:
    """None (the default model) for ngram; for draft, the default model's copy in qtype."""
    if method != "draft":
        return None
    from requantize_gguf import requantize

    from cpud.fixtures.cache import cache_root
    from cpud.model.default_model import default_model_path

    out = cache_root() / "perf" / f"smollm2-135m-instruct-{qtype.lower()}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        requantize(default_model_path(), tmp, qtype)
        tmp.rename(out)
    return str(out)


def model_file(path: str | None) -> Path:
    from cpud.model.default_model import default_model_path

    return Path(path) if path else default_model_path()


def spec_config(args: argparse.Namespace) -> dict:
    spec: dict = {"num_speculative_tokens": args.k}
    if args.method == "draft":
        spec.update(method="draft_model", model=str(model_file(args.draft_model)))
    else:
        spec["method"] = "ngram"
        if args.lookup_min is not None:
            spec["prompt_lookup_min"] = args.lookup_min
        if args.lookup_max is not None:
            spec["prompt_lookup_max"] = args.lookup_max
    return spec


class PeerRunner:
    """llama-server without and with speculation, both started for the whole bench."""

    def __init__(self, args: argparse.Namespace, target: Path, prompts: list[int]):
        from llamacpp_server import DraftSpec, LlamaServer, NgramSpec, ServerConfig

        if args.method == "draft":
            spec = DraftSpec(model_file(args.draft_model), args.k)
        else:
            spec = NgramSpec(args.k, args.peer_ngram_n, args.peer_ngram_kind)
        log = args.peer_log
        self.servers = {
            "llama plain": LlamaServer(ServerConfig(target, args.threads), log=log),
            "llama spec": LlamaServer(ServerConfig(target, args.threads, spec=spec), log=log),
        }
        self.prompt = prompts
        self.drafted = self.accepted = 0
        self.token_counts: dict[str, list[int]] = {name: [] for name in self.servers}

    def __enter__(self) -> PeerRunner:
        for server in self.servers.values():
            server.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for server in self.servers.values():
            server.__exit__(*exc)

    def reset(self) -> None:
        """Counters back to zero (after the warm-up)."""
        self.drafted = self.accepted = 0
        self.token_counts = {name: [] for name in self.servers}

    def describe(self) -> dict[str, str]:
        return {name: server.config.describe() for name, server in self.servers.items()}

    def rate(self, name: str, max_tokens: int) -> float:
        done = self.servers[name].complete(self.prompt, max_tokens)
        self.token_counts[name].append(done.tokens)
        if name == "llama spec":
            self.drafted += done.draft_n
            self.accepted += done.draft_accepted
        return done.decode_tok_s


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=("rewrite", "chat"), default="rewrite")
    parser.add_argument("--method", choices=("ngram", "draft"), default="ngram")
    parser.add_argument("--model", default=None, help="target model (see the docstring)")
    parser.add_argument("--draft-model", default=None, help="draft GGUF (default: default model)")
    parser.add_argument(
        "--target-type", default="Q8_0", help="draft without --model: the target's type (BF16)"
    )
    parser.add_argument("--streams", default="1,32", help="stream counts, comma separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=None, help="prompt_lookup_min")
    parser.add_argument("--lookup-max", type=int, default=None, help="prompt_lookup_max")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--peer", action="store_true", help="llama-server side by side, 1 stream")
    parser.add_argument("--peer-ngram-n", type=int, default=2, help="n-gram lookup length")
    parser.add_argument(
        "--peer-ngram-kind",
        default="ngram-simple",
        choices=("ngram-simple", "ngram-map-k", "ngram-map-k4v"),
        help="llama-server's n-gram --spec-type",
    )
    parser.add_argument("--threads", type=int, default=2, help="llama-server -t")
    parser.add_argument("--peer-log", type=Path, default=None, help="llama-server output here")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    args.model = args.model or default_target(args.method, args.target_type)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    spec = spec_config(args)
    engines = {"plain": LLM(args.model), "spec": LLM(args.model, speculative_config=spec)}
    counts = [int(s) for s in args.streams.split(",")]
    for llm in engines.values():  # warm-up: first-call costs out of the timings
        decode_rate(llm, 1, 16, args.task)
    peer = None
    if args.peer:
        prompt = prompt_ids(engines["plain"], 0, args.task)
        peer = PeerRunner(args, model_file(args.model), prompt).__enter__()
        for name in peer.servers:
            peer.rate(name, 16)
        peer.reset()
    results = {}
    try:
        for streams in counts:
            names = [*engines, *(peer.servers if peer and streams == 1 else [])]
            rates: dict[str, list[float]] = {name: [] for name in names}
            for _ in range(args.rounds):
                for name in names:
                    wait_until_quiet()
                    if name in engines:
                        rate = decode_rate(engines[name], streams, args.max_tokens, args.task)
                    else:
                        rate = peer.rate(name, args.max_tokens)
                    rates[name].append(rate)
            results[streams] = summarize(streams, rates)
    finally:
        if peer is not None:
            peer.__exit__(None, None, None)
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "spec": spec}
    report["results"] = results
    report["cpud_acceptance"] = acceptance(engines["spec"])
    if peer is not None:
        report["peer"] = peer.describe()
        report["peer_tokens"] = peer.token_counts
        share = peer.accepted / peer.drafted if peer.drafted else 0.0
        report["peer_acceptance"] = {"drafted": peer.drafted, "accepted": peer.accepted}
        print(f"llama-server: {peer.accepted}/{peer.drafted} drafts accepted ({share:.0%})")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


def summarize(streams: int, rates: dict[str, list[float]]) -> dict:
    medians = {name: statistics.median(values) for name, values in rates.items()}
    ratios = {"spec/plain": _ratio(medians, "spec", "plain")}
    line = f"{streams:3d} stream(s): plain {medians['plain']:.1f}, spec {medians['spec']:.1f}"
    line += f" tok/s, ratio {ratios['spec/plain']:.2f}"
    if "llama spec" in medians:
        ratios["llama spec/llama plain"] = _ratio(medians, "llama spec", "llama plain")
        ratios["spec/llama spec"] = _ratio(medians, "spec", "llama spec")
        ratios["plain/llama plain"] = _ratio(medians, "plain", "llama plain")
        line += (
            f"; llama-server plain {medians['llama plain']:.1f}, spec "
            f"{medians['llama spec']:.1f} tok/s (ratio {ratios['llama spec/llama plain']:.2f});"
            f" cpud spec / llama spec {ratios['spec/llama spec']:.2f}"
        )
    print(line)
    return {"rates": rates, "medians": medians, "ratios": ratios}


def _ratio(medians: dict[str, float], a: str, b: str) -> float:
    return medians[a] / medians[b] if medians[b] else float("nan")


def acceptance(llm: LLM) -> dict:
    stats = llm.engine.spec.stats
    print(
        f"cpud: {stats.num_accepted_tokens}/{stats.num_draft_tokens} proposals accepted, mean "
        f"accepted length {stats.mean_accepted_length:.2f}, per position "
        f"{stats.accepted_per_position}"
    )
    return {
        "drafts": stats.num_drafts,
        "proposed": stats.num_draft_tokens,
        "accepted": stats.num_accepted_tokens,
        "mean_accepted_length": stats.mean_accepted_length,
        "per_position": stats.accepted_per_position,
    }


if __name__ == "__main__":
    main()
