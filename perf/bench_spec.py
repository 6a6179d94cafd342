"""Speculative decoding (n-gram prompt lookup) against plain decoding on an input-grounded task:
the model rewrites a given document, so most of its output is in its prompt.

Two offline engines on the same model, one with --speculative-config and one without, run
interleaved rounds (A B A B ...); each round decodes `streams` requests at once (greedy, the
same prompt; each request's document differs by its first line so the streams are distinct)
and reports the decode rate: output tokens after each stream's first, per second from the
first token of the round to its end. Medians and the ratio per stream count; the acceptance
counters of the speculative engine.

    python perf/bench_spec.py [--model PATH] [--streams 1,32] [--rounds 3] [--k 4]

Default model: SmolLM2-135M-Instruct (the default). A qwen3-0.6b-shaped fixture:
`cpud model make qwen3 --preset qwen3-0.6b DIR` then --model DIR (random weights: the output
is not a rewrite, so this measures the off-switch more than the gain).

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


def messages(stream: int) -> list[dict]:
    document = DOCUMENT.replace("west reading room", f"west reading room {stream + 1}", 1)
    ask = "Rewrite the following notice exactly, keeping every sentence and its wording:"
    return [{"role": "user", "content": f"{ask}\n\n{document}"}]


def decode_rate(llm: LLM, streams: int, max_tokens: int) -> float:
    """Output tokens per second after the round's first token, `streams` requests at once."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for stream in range(streams):
        text = llm.tokenizer.apply_chat_template(messages(stream))
        prompt = llm.tokenizer.encode(text, add_special_tokens=False)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: the default model)")
    parser.add_argument("--streams", default="1,32", help="stream counts, comma separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k}
    engines = {"plain": LLM(args.model), "ngram": LLM(args.model, speculative_config=spec)}
    counts = [int(s) for s in args.streams.split(",")]
    for llm in engines.values():  # warm-up: first-call costs out of the timings
        decode_rate(llm, 1, 16)
    results = {}
    for streams in counts:
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, llm in engines.items():
                wait_until_quiet()
                rates[name].append(decode_rate(llm, streams, args.max_tokens))
        medians = {name: statistics.median(values) for name, values in rates.items()}
        ratio = medians["ngram"] / medians["plain"] if medians["plain"] else float("nan")
        results[streams] = {"rates": rates, "medians": medians, "ratio": ratio}
        print(
            f"{streams:3d} stream(s): plain {medians['plain']:.1f} tok/s, ngram "
            f"{medians['ngram']:.1f} tok/s, ratio {ratio:.2f}"
        )
    stats = engines["ngram"].engine.spec.stats
    print(
        f"ngram: {stats.num_accepted_tokens}/{stats.num_draft_tokens} proposals accepted, mean "
        f"accepted length {stats.mean_accepted_length:.2f}, per position "
        f"{stats.accepted_per_position}"
    )
    if args.json is not None:
        args.json.write_text(json.dumps({"k": args.k, "results": results}, indent=2))


if __name__ == "__main__":
    main()
