"""Embeddings throughput: cpud vs llama.cpp's `llama-server --embedding` on the same GGUF file,
in inputs/s of 128-token inputs, interleaved rounds (cpud, llama.cpp, cpud, llama.cpp, ...).

    python perf/bench_embeddings.py                        # bge-small-shaped BERT fixture, F16
    python perf/bench_embeddings.py --rounds 5 --qtype Q8_0
    python perf/bench_embeddings.py --gguf FILE.gguf       # any embedding GGUF (a tokenizer in it)
    python perf/bench_embeddings.py --arch qwen3_embed --shape tiny   # the decoder fixture
    python perf/bench_embeddings.py --shape tiny --rounds 1 --inputs 64   # smoke test

Two loads per round, each over --inputs inputs of --tokens token ids (the same ids for both
servers, sent as token ids so that both embed exactly the same tokens):

  single  --concurrency clients (default 32), each request one input
  batch   --batch-clients clients (default 2), each request --batch inputs (default 16)

Each round starts the server, warms it up (two loads of 32 inputs), measures both loads and
stops it: one server alive at a time. Figures are medians over rounds; the ratio cpud/llama.cpp
is taken round by round. The first round also compares the two servers' vectors of the same
inputs (cosine), a check that both embed alike (same pooling, same normalisation).

The GGUF: --gguf as given, else the fixture of --arch (default bert) in --shape (default
bge-small: hidden 384, 12 layers, 12 heads, FFN 1536, 30522-token vocabulary; tiny: the test
fixture) written by tests/gguf_writer.py with every matrix in --qtype, cached under
~/.cache/cpud/peers/gguf. llama.cpp comes from perf/peers/llamacpp.py (ensure_built: the
sdist's sources built once with GGML_NATIVE). Servers: `cpud serve --model FILE` (--cpud-dtype,
default auto) and `llama-server -m FILE --embedding -np <concurrency> -t <threads>`, both on
--threads cores' worth of threads (cpud: its binding plan, the CPUs it is given).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "peers"), str(HERE.parent / "tests")]

from serving_server import (  # noqa: E402
    Server,
    ServerCrash,
    Target,
    base_env,
    free_port,
    one_line,
)

TARGET_RATIO = 1.2  # cpud / llama.cpp inputs/s, each load
# bge-small-en-v1.5's shape (BertModel)
BGE_SMALL = {
    "hidden_size": 384,
    "num_layers": 12,
    "num_heads": 12,
    "num_kv_heads": 12,
    "head_dim": 32,
    "intermediate_size": 1536,
    "max_position_embeddings": 512,
    "vocab_size": 30522,
    "bpe_vocab_size": 4096,
}
SHAPES = ("bge-small", "tiny")
QTYPES = ("F32", "F16", "Q8_0")


def log(message: str) -> None:
    print(f"[bench_embeddings] {message}", file=sys.stderr, flush=True)


# ---- the model -----------------------------------------------------------------------------


def source_key() -> str:
    """Changes with the code that writes fixtures and their GGUF files: a cached file made by
    other code is not reused."""
    import cpud.fixtures

    package = Path(cpud.fixtures.__file__).parent
    tests = HERE.parent / "tests"
    sources = [*sorted(package.rglob("*.py")), *sorted(package.glob("*.jinja"))]
    sources += [tests / "gguf_writer.py", tests / "gguf_vocab.py"]
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:10]


def fixture_dir(arch: str, shape: str, cache: Path) -> Path:
    """The fixture directory of arch in `shape`, made once (bge-small: the tiny preset's
    architecture with bge-small's published sizes)."""
    from cpud.fixtures import make_model, presets

    out = cache / "fixtures" / f"{arch}-{shape}-{source_key()}"
    if out.is_dir():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if shape == "tiny":
        make_model(arch, "tiny", tmp)
    else:
        sized = replace(presets.TINY[arch], **BGE_SMALL)
        with mock.patch.dict(presets.TINY, {arch: sized}):
            make_model(arch, "tiny", tmp)
    tmp.rename(out)
    return out


def fixture_gguf(arch: str, shape: str, qtype: str, cache: Path) -> tuple[Path, Path]:
    """(GGUF file, its fixture directory), written once."""
    import gguf
    import gguf_writer

    model_dir = fixture_dir(arch, shape, cache)
    path = cache / "gguf" / f"{model_dir.name}-{qtype}.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        log(f"writing {path.name} from {model_dir}")
        gguf_writer.write_gguf(model_dir, tmp, gguf.GGMLQuantizationType[qtype])
        tmp.rename(path)
    return path, model_dir


def inputs_for(model: Path, count: int, tokens: int) -> list[list[int]]:
    """`count` inputs of exactly `tokens` token ids: English text as the model's tokenizer
    encodes it (with its special tokens, as a string input would get them), each from its own
    offset into the text."""
    from cpud.text.tokenizer import Tokenizer

    tokenizer = Tokenizer(model)
    probe = tokenizer.encode("x", add_special_tokens=False)
    wrapped = tokenizer.encode("x")
    start = next(i for i in range(len(wrapped)) if wrapped[i : i + len(probe)] == probe)
    prefix, suffix = wrapped[:start], wrapped[start + len(probe) :]
    body = tokens - len(prefix) - len(suffix)
    text = " ".join(
        "The quick brown fox jumps over the lazy dog, then sleeps in the sun near river "
        f"number {i} while the band plays tune {i * 7 % 13}."
        for i in range(count + body)
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < count + body:
        raise RuntimeError(f"the text has only {len(ids)} tokens under {model}")
    return [prefix + ids[i * 3 % (len(ids) - body) :][:body] + suffix for i in range(count)]


# ---- the servers ---------------------------------------------------------------------------


def cpud_target(gguf: Path, args: argparse.Namespace) -> Target:
    port = free_port()
    cmd = [sys.executable, "-m", "cpud.cli", "serve", "--model", str(gguf)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "embed"]
    cmd += ["--dtype", args.cpud_dtype, "--max-model-len", str(args.context)]
    cmd += ["--max-num-seqs", str(max(args.concurrency, args.batch * args.batch_clients))]
    cmd += ["--max-pending-requests", "4096", *args.cpud_arg]
    return Target("cpud", cmd, base_env(), port, "embed", 300)


def llamacpp_target(gguf: Path, args: argparse.Namespace) -> Target:
    import llamacpp

    bin_dir = llamacpp.ensure_built()
    port = free_port()
    slots = max(args.concurrency, args.batch * args.batch_clients)
    cmd = [str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "-t", str(args.threads), "-tb", str(args.threads)]
    cmd += ["--embedding", "-np", str(slots), "-c", str(slots * args.context)]
    # Every input in one micro-batch (an encoder's attention needs all of its tokens at once).
    cmd += ["-b", str(args.llama_batch), "-ub", str(args.llama_batch), "-kvu", "--no-webui"]
    cmd += ["--alias", "embed", *args.llama_arg]
    return Target("llama.cpp", cmd, base_env(), port, "embed", 120, {"bin_dir": str(bin_dir)})


def post_embeddings(client: Any, target: Target, batch: list[list[int]]) -> list[list[float]]:
    body = {"model": target.model, "input": batch, "encoding_format": "float"}
    reply = client.post(target.url + "/v1/embeddings", json=body)
    if reply.status_code >= 500:
        raise ServerCrash(f"HTTP {reply.status_code}: {one_line(reply.text)[:300]}")
    if reply.status_code != 200:
        raise RuntimeError(f"HTTP {reply.status_code}: {one_line(reply.text)[:300]}")
    data = sorted(reply.json()["data"], key=lambda d: d["index"])
    if len(data) != len(batch):
        raise RuntimeError(f"{len(data)} embeddings for {len(batch)} inputs")
    return [d["embedding"] for d in data]


def run_load(
    server: Server, inputs: list[list[int]], per_request: int, clients: int
) -> dict[str, Any]:
    """Every input sent once, `per_request` per request, by `clients` concurrent clients."""
    import httpx

    target = server.target
    batches = [inputs[i : i + per_request] for i in range(0, len(inputs), per_request)]
    lock = threading.Lock()
    latencies: list[float] = []
    next_batch = iter(batches)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    with httpx.Client(timeout=600, limits=limits) as client:

        def worker() -> None:
            while True:
                with lock:
                    batch = next(next_batch, None)
                if batch is None:
                    return
                sent = time.perf_counter()
                try:
                    post_embeddings(client, target, batch)
                except (OSError, httpx.HTTPError):
                    server.check_alive("the load")
                    raise
                with lock:
                    latencies.append(time.perf_counter() - sent)

        cpu_before = server.cpu_seconds()
        started = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            for future in [pool.submit(worker) for _ in range(clients)]:
                future.result()
        seconds = time.perf_counter() - started
        cpu = server.cpu_seconds() - cpu_before
    server.check_alive("the load")
    latencies.sort()
    return {
        "inputs": len(inputs),
        "seconds": seconds,
        "inputs_per_s": len(inputs) / seconds,
        "request_p50_s": latencies[len(latencies) // 2],
        "request_p99_s": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
        "server_cpu_s": cpu,
    }


def loads(args: argparse.Namespace) -> dict[str, tuple[int, int]]:
    """load name -> (inputs per request, concurrent clients)."""
    return {
        f"single-{args.concurrency}": (1, args.concurrency),
        f"batch{args.batch}-{args.batch_clients}": (args.batch, args.batch_clients),
    }


def one_round(
    target: Target, inputs: list[list[int]], args: argparse.Namespace, log_dir: Path
) -> tuple[dict[str, Any], list[list[float]]]:
    """(figures of each load, vectors of the first inputs) of one started server."""
    import httpx

    server = Server(target, log_dir)
    ready_s = server.start()
    try:
        warm = inputs[: min(32, len(inputs))]
        run_load(server, warm, 1, min(args.concurrency, len(warm)))
        run_load(server, warm, min(args.batch, len(warm)), 1)
        figures: dict[str, Any] = {"ready_s": ready_s}
        for name, (per_request, clients) in loads(args).items():
            figures[name] = run_load(server, inputs, per_request, clients)
        with httpx.Client(timeout=600) as client:
            vectors = post_embeddings(client, target, inputs[:4])
    finally:
        server.stop()
    return figures, vectors


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def summary(rounds: list[dict[str, dict[str, Any]]], names: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        per_target: dict[str, Any] = {}
        for target in ("cpud", "llama.cpp"):
            values = [r[target][name]["inputs_per_s"] for r in rounds if target in r]
            if values:
                per_target[target] = {"median": statistics.median(values), "samples": values}
        ratios = [
            r["cpud"][name]["inputs_per_s"] / r["llama.cpp"][name]["inputs_per_s"]
            for r in rounds
            if "cpud" in r and "llama.cpp" in r
        ]
        if ratios:
            median = statistics.median(ratios)
            per_target["ratio"] = {"median": median, "samples": ratios}
            per_target["met"] = median >= TARGET_RATIO
        out[name] = per_target
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, help="an embedding GGUF (default: the fixture)")
    parser.add_argument("--arch", default="bert", help="fixture architecture (bert, qwen3_embed)")
    parser.add_argument("--shape", choices=SHAPES, default="bge-small")
    parser.add_argument("--qtype", choices=QTYPES, default="F16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inputs", type=int, default=512, help="inputs per load")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per input")
    parser.add_argument("--concurrency", type=int, default=32, help="clients of the single load")
    parser.add_argument("--batch", type=int, default=16, help="inputs per request, batch load")
    parser.add_argument("--batch-clients", type=int, default=2)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--context", type=int, default=512, help="max model len / slot context")
    parser.add_argument("--llama-batch", type=int, default=2048, help="llama-server -b and -ub")
    parser.add_argument("--cpud-dtype", default="auto")
    parser.add_argument("--cpud-arg", action="append", default=[], help="extra cpud serve arg")
    parser.add_argument("--llama-arg", action="append", default=[], help="extra llama-server arg")
    parser.add_argument("--target", action="append", choices=["cpud", "llama.cpp"])
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import llamacpp

    cache = args.cache_dir or llamacpp.default_cache_dir()
    if args.gguf is not None:
        gguf, tokenizer_src = args.gguf, args.gguf
    else:
        gguf, tokenizer_src = fixture_gguf(args.arch, args.shape, args.qtype, cache)
    inputs = inputs_for(tokenizer_src, args.inputs, args.tokens)
    targets = args.target or ["cpud", "llama.cpp"]
    makers = {"cpud": cpud_target, "llama.cpp": llamacpp_target}
    log_dir = cache / "logs" / f"embeddings-{time.strftime('%Y%m%d-%H%M%S')}"
    rounds: list[dict[str, dict[str, Any]]] = []
    failures: list[str] = []
    first_vectors: dict[str, list[list[float]]] = {}
    commands: dict[str, str] = {}
    load_before = os.getloadavg()[0]
    for index in range(args.rounds):
        order = targets if index % 2 == 0 else targets[::-1]
        figures: dict[str, dict[str, Any]] = {}
        for name in order:
            target = makers[name](gguf, args)
            commands[name] = " ".join(target.cmd)
            try:
                figures[name], vectors = one_round(target, inputs, args, log_dir)
            except (ServerCrash, RuntimeError, OSError) as exc:
                failures.append(f"round {index + 1}, {name}: {type(exc).__name__}: {exc}")
                log(failures[-1])
                continue
            first_vectors.setdefault(name, vectors)
            line = "  ".join(
                f"{load} {figures[name][load]['inputs_per_s']:8.1f} inputs/s"
                for load in loads(args)
            )
            log(f"round {index + 1} {name:>9}: {line}")
        rounds.append(figures)
    names = list(loads(args))
    result: dict[str, Any] = {
        "gguf": str(gguf),
        "arch": None if args.gguf else args.arch,
        "shape": None if args.gguf else args.shape,
        "qtype": None if args.gguf else args.qtype,
        "tokens_per_input": args.tokens,
        "inputs_per_load": args.inputs,
        "threads": args.threads,
        "commands": commands,
        "loadavg_1m": [load_before, os.getloadavg()[0]],
        "rounds": rounds,
        "summary": summary(rounds, names),
        "failures": failures,
        "target": f"cpud >= {TARGET_RATIO}x llama.cpp inputs/s",
    }
    if "cpud" in first_vectors and "llama.cpp" in first_vectors:
        pairs = zip(first_vectors["cpud"], first_vectors["llama.cpp"])
        result["cosine_cpud_llamacpp"] = [cosine(a, b) for a, b in pairs]
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{gguf.name}: {args.inputs} inputs of {args.tokens} tokens per load, {args.rounds} rounds"
    )
    for name, figures in result["summary"].items():
        cells = [f"{t} {figures[t]['median']:8.1f} inputs/s" for t in targets if t in figures]
        if "ratio" in figures:
            met = "met" if figures["met"] else "NOT met"
            cells.append(f"ratio {figures['ratio']['median']:.2f}x ({met}: >= {TARGET_RATIO}x)")
        print(f"  {name:>12}: " + "  ".join(cells))
    if "cosine_cpud_llamacpp" in result:
        print(f"  cosine cpud vs llama.cpp: min {min(result['cosine_cpud_llamacpp']):.5f}")
    print(f"  load average 1m before/after: {load_before:.2f} / {result['loadavg_1m'][1]:.2f}")
    for failure in failures:
        print(f"  failed: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
