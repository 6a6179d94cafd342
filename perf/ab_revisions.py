"""Decode speed of two revisions of cpud on the same model files, interleaved A B A B.

Each revision is checked out into a git worktree with its own native build and imported
through a small import root (cpud -> its daemon/, cpud.ranks -> its ranks/, ...), so both run
the same measurement (perf/ab_revisions_child.py) on the same machine in the same minutes:
one rank, native kernels, fused decoder, decode of 1 and of 32 streams straight on ModelRunner
steps, and prefill of one 512-token prompt. The working tree itself is revision "work".

    python3 perf/ab_revisions.py --before 47ef048 --model smollm2 --model qwen3-0.6b-Q8_0 \
        --model qwen3-0.6b-Q4_K_M --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).resolve().parent / "ab_revisions_child.py"
SUBPACKAGES = {"ranks": "ranks", "native": "native", "protocol": "protocol"}


def checkout(rev: str, workdir: Path) -> Path:
    """A worktree of `rev` with its native library built; "work" is this working tree."""
    if rev == "work":
        return ROOT
    tree = workdir / f"tree-{rev}"
    if not tree.exists():
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True
        )
    if not list((tree / "native").glob("_cpud_native*.so")):
        subprocess.run([sys.executable, str(tree / "native" / "build_native.py")], check=True)
    return tree


def import_root(tree: Path, workdir: Path, name: str) -> Path:
    """A directory whose `cpud` package is the tree's daemon/ with its subpackages linked in."""
    root = workdir / f"import-{name}"
    if root.exists():
        shutil.rmtree(root)
    package = root / "cpud"
    shutil.copytree(tree / "daemon", package, symlinks=True)
    for sub, folder in SUBPACKAGES.items():
        (package / sub).symlink_to(tree / folder)
    return root


def q4_k_m(name: str, shape: tuple[int, ...]) -> object:
    """llama.cpp's Q4_K_M mix on a dense model: attn_v, ffn_down and output in Q6_K, the rest
    Q4_K."""
    from gguf import GGMLQuantizationType

    if ".attn_v." in name or ".ffn_down." in name or name.startswith("output."):
        return GGMLQuantizationType.Q6_K
    return GGMLQuantizationType.Q4_K


def model_path(name: str, workdir: Path) -> Path:
    """smollm2: the default model's GGUF; qwen3-0.6b-bf16: the realistic fixture; qwen3-0.6b-Q4_K
    (or another GGUF type, or Q4_K_M: llama.cpp's mix): that fixture as a GGUF of that type."""
    if name == "smollm2":
        from cpud.model.default_model import default_model_path

        return default_model_path()
    from cpud.fixtures import make_model

    dense = name == "qwen3-0.6b-bf16"
    # the GGUF writer reads the checkpoint through numpy, which has no bfloat16
    source = workdir / ("qwen3-0.6b-hf" if dense else "qwen3-0.6b-hf-f32")
    if not (source / "config.json").exists():
        dtype = "bfloat16" if dense else "float32"
        make_model("qwen3", "qwen3-0.6b", source, dtype=dtype, max_shard_bytes=1 << 40)
    if dense:
        return source
    qtype = name.removeprefix("qwen3-0.6b-")
    out = workdir / f"qwen3-0.6b-{qtype}.gguf"
    if not out.exists():
        sys.path.insert(0, str(ROOT / "tests"))
        from gguf import GGMLQuantizationType
        from gguf_writer import write_gguf

        write_gguf(source, out, q4_k_m if qtype == "Q4_K_M" else GGMLQuantizationType[qtype])
    return out


def measure(root: Path, model: Path, steps: int, threads: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONNOUSERSITE": "1"}
    cmd = [sys.executable, str(CHILD), str(model), str(steps), str(threads)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, cwd=root)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="git revision to compare with")
    ap.add_argument("--after", default="work", help="git revision, or work (the working tree)")
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/cpud-ab"))
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    roots = {
        rev: import_root(checkout(rev, args.workdir), args.workdir, rev)
        for rev in (args.before, args.after)
    }
    models = {name: model_path(name, args.workdir) for name in args.model}
    runs: dict[str, dict[str, dict[str, list[float]]]] = {
        m: {rev: {} for rev in roots} for m in models
    }
    for _ in range(args.rounds):
        for name, path in models.items():
            for rev, root in roots.items():
                for key, value in measure(root, path, args.steps, args.threads).items():
                    runs[name][rev].setdefault(key, []).append(value)
    summary: dict[str, object] = {"before": args.before, "after": args.after, "runs": runs}
    ratios = {}
    for name, by_rev in runs.items():
        before, after = by_rev[args.before], by_rev[args.after]
        ratios[name] = {
            key: statistics.median(a / b for a, b in zip(after[key], before[key])) for key in before
        }
    summary["after_over_before"] = ratios
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
