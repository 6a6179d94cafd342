"""Start to ready of plain `cpud` (the default model), warm: the weight cache already holds the
shard and the page cache holds the files.

    python perf/bench_startup.py --rounds 3            # one filling start, then 3 measured
    python perf/bench_startup.py --rounds 3 --json out.json -- --tp 2   # extra cpud flags
    python perf/bench_startup.py --rounds 3 --fresh 3  # 3 rounds of starts 1..3, each round
                                                       # from an empty cache folder

Each round starts `cpud --port N` in its own session with CPUD_CACHE_DIR pointing at one
folder kept across rounds, polls /health every 20 ms until it answers 200, then stops the
daemon with SIGINT. With --fresh S each round starts from an empty cache folder and times S
starts, the first of which fills the cache; the medians are then per start. Each start first
waits (up to 30 s) for the machine's CPUs to go quiet (perf/quiet.py: a wait of 30 s means they
never did). Besides the wall time it reports the CPU seconds each process (supervisor, frontend,
ranks) used until ready, less sensitive to a busy machine than the wall time, and the phases
read from the log: plan (supervisor imported, model checked, placement planned), http (the
frontend listens), rank (rank 0 reported READY), ready (the supervisor said ready). Times are
seconds after the spawn. The machine may be shared: compare rounds of one run, and report the
median.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quiet import wait_until_quiet  # noqa: E402
from serving_server import free_port  # noqa: E402

STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (.*)$")
# phase -> the first log line that ends it
PHASES = {
    "plan": re.compile(r"cpud\.placement INFO"),
    "http": re.compile(r"hypercorn\.error INFO Running on"),
    "mapped": re.compile(r"weight cache: packed weights mapped"),
    "rank": re.compile(r"cpud\.ranks INFO rank 0 ready"),
    "ready": re.compile(r"cpud\.supervisor INFO ready in"),
}
HUGE_SHARE = re.compile(r"weight cache: packed weights mapped from .*?([\d.]+) % on 2 MiB pages")
POLL_S = 0.02


ROLES = ((b"cpud.ranks.worker", "rank"), (b"cpud.frontend.server", "frontend"))


def cpu_by_role(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of the supervisor `pid` and of its children, by role."""
    tick = os.sysconf("SC_CLK_TCK")
    found = {"supervisor_cpu": 0.0, "frontend_cpu": 0.0, "rank_cpu": 0.0}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(entry.name) != pid and int(fields[1]) != pid:
            continue
        role = next((name for marker, name in ROLES if marker in cmdline), "supervisor")
        found[f"{role}_cpu"] += (int(fields[11]) + int(fields[12])) / tick
    return {k: round(v, 2) for k, v in found.items()}


def health(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def phases(log: str, spawned: float) -> dict[str, float]:
    """Seconds after the spawn at which each phase's log line appeared."""
    found: dict[str, float] = {}
    for line in log.splitlines():
        match = STAMP.match(line)
        if match is None:
            continue
        at = datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        for name, pattern in PHASES.items():
            if name not in found and pattern.search(match[2]):
                found[name] = round(at - spawned, 3)
    return found


def start_once(flags: list[str], env: dict[str, str], log_path: Path, timeout_s: float) -> dict:
    waited = wait_until_quiet(max_busy_cores=0.3, timeout_s=30.0)
    port = free_port()
    with log_path.open("w") as log:
        spawned = time.time()
        started = time.perf_counter()
        proc = subprocess.Popen(
            ["cpud", "--port", str(port), *flags],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        ready = None
        cpu: dict[str, float] = {}
        try:
            while time.perf_counter() - started < timeout_s:
                if proc.poll() is not None:
                    break
                cpu = cpu_by_role(proc.pid)
                if health(port) == 200:
                    ready = time.perf_counter() - started
                    break
                time.sleep(POLL_S)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    text = log_path.read_text()
    if ready is None:
        tail = " | ".join(text.strip().splitlines()[-5:])
        raise SystemExit(f"cpud did not get ready (exit {proc.returncode}): {tail}")
    found = {"quiet_wait_s": round(waited, 1)}
    if match := HUGE_SHARE.search(text):
        found["huge_pct"] = float(match[1])
        found["reread"] = int("dropped and read again" in text)
    return {"ready_s": round(ready, 3), **phases(text, spawned), **cpu, **found}


def cache_bytes(cache_dir: Path) -> int:
    """Bytes of the packed weight files in the cache folder."""
    return sum(p.stat().st_size for p in cache_dir.rglob("*.bin"))


def fresh_rounds(args: argparse.Namespace, tmp: Path) -> dict:
    """`args.rounds` rounds of `args.fresh` starts, each round on an empty cache folder."""
    env = dict(os.environ)
    rounds: list[list[dict]] = []
    for n in range(args.rounds):
        cache_dir = tmp / f"cache{n}"
        env["CPUD_CACHE_DIR"] = str(cache_dir)
        starts = []
        for k in range(args.fresh):
            result = start_once(args.flags, env, tmp / f"r{n}s{k}.log", args.timeout)
            result["cache_bytes"] = cache_bytes(cache_dir)
            starts.append(result)
            detail = "  ".join(f"{key} {v:.2f}" for key, v in result.items() if key != "ready_s")
            print(
                f"round {n + 1} start {k + 1}: ready in {result['ready_s']:.2f} s  ({detail})",
                flush=True,
            )
        shutil.rmtree(cache_dir, ignore_errors=True)
        rounds.append(starts)
    median = {}
    for k in range(args.fresh):
        runs = [r[k] for r in rounds]
        keys = [key for key in runs[0] if all(key in r for r in runs)]
        median[f"start{k + 1}"] = {
            key: round(statistics.median(r[key] for r in runs), 3) for key in keys
        }
        detail = "  ".join(f"{key} {v:.2f}" for key, v in median[f"start{k + 1}"].items())
        print(f"median start {k + 1}: {detail}")
    return {"flags": args.flags, "rounds": rounds, "median": median}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="measured warm starts")
    parser.add_argument("--cache-dir", help="CPUD_CACHE_DIR of every start (default: a temp dir)")
    parser.add_argument(
        "--fresh",
        type=int,
        default=0,
        help="S: each round starts on an empty cache folder and times S starts (1 fills it)",
    )
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for ready")
    parser.add_argument("--json", help="write the rounds and medians here")
    parser.add_argument("flags", nargs="*", help="extra cpud flags (after --)")
    args = parser.parse_args()
    if args.fresh:
        with tempfile.TemporaryDirectory(prefix="cpud-startup-") as tmp:
            out = fresh_rounds(args, Path(tmp))
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        return
    with tempfile.TemporaryDirectory(prefix="cpud-startup-") as tmp:
        env = dict(os.environ)
        env["CPUD_CACHE_DIR"] = args.cache_dir or str(Path(tmp) / "cache")
        fill = start_once(args.flags, env, Path(tmp) / "fill.log", args.timeout)
        print(f"filling start: ready in {fill['ready_s']:.2f} s", flush=True)
        rounds = []
        for n in range(args.rounds):
            result = start_once(args.flags, env, Path(tmp) / f"warm{n}.log", args.timeout)
            rounds.append(result)
            detail = "  ".join(f"{k} {v:.2f}" for k, v in result.items() if k != "ready_s")
            print(f"warm start {n + 1}: ready in {result['ready_s']:.2f} s  ({detail})", flush=True)
    keys = sorted({k for r in rounds for k in r}, key=lambda k: [*rounds[0]].index(k))
    median = {k: round(statistics.median(r[k] for r in rounds if k in r), 3) for k in keys}
    print("median: " + "  ".join(f"{k} {v:.2f}" for k, v in median.items()))
    if args.json:
        out = {"flags": args.flags, "fill": fill, "rounds": rounds, "median": median}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
