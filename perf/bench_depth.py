"""Decode at depth: one stream's decode speed with 512, 4096 and 16384 tokens of context, cpud
with a bf16 KV cache against an int8 one (--kv-cache-dtype; fp8 and fp8_e5m2 too with --kv), and
llama.cpp's `llama-bench -d` on the same GGUF file (f16 KV and q8_0 KV, flash attention on).
Rounds alternate A B A B; medians and ratios per depth.

cpud: a ModelRunner per KV dtype (native kernels, bf16 activations, fused decoder), its cache
filled with random rows up to the depth (a decode step's cost does not depend on the cached
values, so no prefill is timed or waited for), then --steps decode steps at positions depth,
depth + 1, ... through the fused decoder, the LM head and the argmax.

    python perf/bench_depth.py --make Q4_K_M [--workdir /tmp/gguf-bench] [--depths 512,4096,16384]
    python perf/bench_depth.py --gguf FILE [--no-llamacpp] [--kv bf16,int8,fp8,fp8_e5m2]

The first --make Q4_K_M writes the F32 fixture and runs llama-quantize (minutes on 2 cores);
later runs reuse the file.  llama-bench fills its depth by a real prefill, so depth 16384 costs
it a minute or more per round and KV type.  Do not run it beside other work: it is a timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "peers"))

from suite import machine  # noqa: E402

from cpud import native  # noqa: E402
from cpud.model.load import load_model_config  # noqa: E402
from cpud.ranks.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from cpud.ranks.paged_kv import AttentionMetadata, quantize_kv  # noqa: E402
from cpud.ranks.parallel import SingleRank  # noqa: E402

BLOCK = 16
FILL_BLOCKS = 256  # blocks of random rows made at a time while filling a cache
# llama.cpp's KV types beside cpud's: bf16 against its f16 cache, int8 and fp8 (e4m3, a byte
# and a row scale) against q8_0
LLAMACPP_KV = {
    "auto": "f16",  # the runner's bf16 activations
    "bf16": "f16",
    "int8": "q8_0",
    "fp8": "q8_0",
    "fp8_e4m3": "q8_0",
    "fp8_e5m2": None,
}


def runner(path: Path, kv: str, depth: int, steps: int) -> ModelRunner:
    blocks = -(-(depth + steps + 1) // BLOCK) + 1
    config = RunnerConfig(
        path,
        torch.bfloat16,
        depth + steps + BLOCK,
        BLOCK,
        blocks,
        kernels="native",
        kv_pretouch=False,
        kv_cache_dtype=kv,
    )
    run = ModelRunner(config, load_model_config(path), SingleRank())
    if run.decoder is None:
        raise SystemExit(f"{path}: the fused decoder does not run this model")
    return run


def fill_cache(run: ModelRunner, seed: int = 0) -> None:
    """Every cache row: random bf16 values (std 1), stored in the cache's format."""
    gen = torch.Generator().manual_seed(seed)
    head_dim = run.model.head_dim
    for pair in run.kv_caches:
        for cache in pair:
            blocks, heads, block_size, _ = cache.shape
            for b0 in range(0, blocks, FILL_BLOCKS):
                n = min(FILL_BLOCKS, blocks - b0)
                rows = torch.randn(n, heads, block_size, head_dim, generator=gen)
                cache[b0 : b0 + n] = quantize_kv(rows.bfloat16(), cache.dtype)


def step_meta(position: int, table: torch.Tensor) -> AttentionMetadata:
    """One sequence decoding the token at `position` (blocks 0, 1, ... in order)."""
    return AttentionMetadata(
        slot_mapping=torch.tensor([position]),
        query_starts=[0],
        query_lens=[1],
        seq_lens=[position + 1],
        block_size=BLOCK,
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens_tensor=torch.tensor([position + 1], dtype=torch.int32),
        block_tables_i32=table,
    )


def decode(run: ModelRunner, depth: int, steps: int) -> float:
    """Output tok/s of `steps` decode steps starting at position depth."""
    table = torch.arange(run.kv_caches[0][0].shape[0], dtype=torch.int32)[None, :]
    metas = [step_meta(depth + i, table) for i in range(steps)]
    token = torch.tensor([11])
    with torch.inference_mode():
        run.decoder.forward(token, torch.tensor([depth]), metas[0])  # warm
        t0 = time.perf_counter()
        for i, meta in enumerate(metas):
            hidden = run.decoder.forward(token, torch.tensor([depth + i]), meta)
            token = run.ops.argmax(run.model.compute_logits(hidden))
    return steps / (time.perf_counter() - t0)


def llamacpp_decode(gguf: Path, kv: str, depth: int, steps: int, threads: int) -> float:
    import llamacpp

    args = ["-p", "0", "-n", str(steps), "-d", str(depth), "-fa", "1", "-ctk", kv, "-ctv", kv]
    (record,) = llamacpp.llama_bench(gguf, args, threads, 1)
    return float(record["avg_ts"])


def make_gguf(qtype: str, workdir: Path) -> Path:
    """The qwen3-0.6b-shaped fixture as a GGUF of qtype: written directly (tests/gguf_writer.py),
    or for Q4_K_M by llama.cpp's llama-quantize from the F32 file, as users make theirs."""
    from bench_gguf_decode import make_file

    if qtype != "Q4_K_M":
        return make_file(qtype, workdir)
    import llamacpp

    f32 = make_file("F32", workdir)
    return llamacpp.quantize(f32, workdir / "qwen3-0.6b-Q4_K_M.gguf", "Q4_K_M")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", type=Path)
    src.add_argument(
        "--make",
        choices=("Q4_K_M", "Q4_K", "Q8_0", "Q4_0"),
        help="the qwen3-0.6b-shaped fixture as that type (Q4_K_M: llama-quantize of its F32 file)",
    )
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/gguf-bench"))
    ap.add_argument("--depths", default="512,4096,16384")
    ap.add_argument(
        "--kv",
        default="bf16,int8",
        help=f"cpud KV cache dtypes ({', '.join(LLAMACPP_KV)}), the first the base",
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument(
        "--llamacpp-kv",
        default="f16,q8_0",
        help="llama.cpp's KV types to run (its q8_0 run at 16384 takes very long on 2 cores)",
    )
    ap.add_argument("--out", type=Path, help="also write the summary JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.gguf:
        path = args.gguf
    else:
        path = make_gguf(args.make, args.workdir)
    depths = [int(d) for d in args.depths.split(",")]
    kvs = args.kv.split(",")
    unknown = [k for k in kvs if k not in LLAMACPP_KV]
    if unknown:
        ap.error(f"--kv {','.join(unknown)}: choose from {', '.join(LLAMACPP_KV)}")
    wanted = set(args.llamacpp_kv.split(","))
    peer_kvs = [] if args.no_llamacpp else [LLAMACPP_KV[k] for k in kvs if LLAMACPP_KV.get(k)]
    peer_kvs = [p for p in dict.fromkeys(peer_kvs) if p in wanted]
    samples: dict[str, dict[int, list[float]]] = {}
    for depth in depths:
        runs = {kv: runner(path, kv, depth, args.steps) for kv in kvs}
        for run in runs.values():
            fill_cache(run)
        for _ in range(args.rounds):
            for kv, run in runs.items():
                got = decode(run, depth, args.steps)
                samples.setdefault(f"cpud {kv}", {}).setdefault(depth, []).append(got)
            for peer in peer_kvs:
                got = llamacpp_decode(path, peer, depth, args.steps, args.threads)
                samples.setdefault(f"llama.cpp {peer}", {}).setdefault(depth, []).append(got)
        del runs
    tok_s = {name: {d: statistics.median(v) for d, v in by.items()} for name, by in samples.items()}
    base = f"cpud {kvs[0]}"
    ratios: dict[str, dict[int, float]] = {}
    for kv in kvs[1:]:
        ratios[f"cpud {kv} / {base}"] = {d: tok_s[f"cpud {kv}"][d] / tok_s[base][d] for d in depths}
    for kv in kvs:  # each cpud cache against its llama.cpp counterpart and against f16
        for peer_kv in dict.fromkeys((LLAMACPP_KV.get(kv), "f16")):
            peer = f"llama.cpp {peer_kv}"
            if peer_kv in peer_kvs:
                ratios[f"cpud {kv} / {peer}"] = {
                    d: tok_s[f"cpud {kv}"][d] / tok_s[peer][d] for d in depths
                }
    summary = {
        "machine": machine(),
        "isa": native.Kernels().isa,
        "file": str(path),
        "threads": args.threads,
        "rounds": args.rounds,
        "steps": args.steps,
        "decode_1_tok_s": tok_s,
        "ratios": ratios,
        "per_round": samples,
    }
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
