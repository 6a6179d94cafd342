"""cpud against llama.cpp on one quantized MoE GGUF file, interleaved rounds (llama.cpp, cpud,
llama.cpp, cpud, ...): prefill 512 (llama-bench pp512), decode 1 stream (tg64) and decode 32
streams (llama-batched-bench S_TG) beside perf/bench_moe.py's figures on the same file.

    python perf/bench_moe_peer.py --quant Q4_K_M [--rounds 2] [--json OUT]
    python perf/bench_moe_peer.py --preset gpt-oss-20b-4l [--rounds 2] [--json OUT]
    python perf/bench_moe_peer.py --gguf FILE.gguf

--quant makes (once) the qwen3-30b-a3b-6l fixture as a GGUF file of that mix in --workdir, as
bench_moe.py does; --preset gpt-oss-20b-4l the gpt-oss fixture as a GGUF file with MXFP4
experts (perf/bench_moe_gptoss.py). cpud's side also reports its resident memory against the
file's size, decode 1's phases and read rates against the read probe. llama.cpp comes from
perf/peers/llamacpp.py (b11434); perf/bench_moe_check.py checks both read the file alike.

The host's read rate may change by itself between and within runs: the read probe is measured
right before and after llama.cpp's decode 1 too, and a round whose probe readings (those two,
cpud's before its decode, and cpud's LM head read alone) spread by more than MIXED_SPREAD is
marked "mixed_periods": its decode 1 ratio compares two engines at two memory speeds;
"decode_1_by_period" compares the engines' decode 1 within one period (perf/read_periods.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))

import llamacpp  # noqa: E402
from read_periods import mixed, paired_by_period  # noqa: E402


def cpud_round(gguf: Path, threads: int, steps: int) -> dict:
    cmd = [sys.executable, str(HERE / "bench_moe.py"), "--model", str(gguf), "--rounds", "1"]
    cmd += ["--steps", str(steps), "--threads", str(threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    summary = json.loads(out[out.index("{") :])
    median = summary["median"]
    decode_1 = median["decode_1"]
    return {
        "read_probe_gbs": summary["read_probe_gbs"],
        "decode_1_of_probe": summary["decode_1_of_probe"],
        "prefill_512": median["prefill_512"],
        "decode_1": decode_1["tok_s"],
        "decode_32": median["decode_32"]["tok_s"],
        "decode_1_read_gbs": decode_1["read_gbs"],
        "decode_1_phase_ms": decode_1.get("phase_ms"),
        "decode_1_phase_bytes": decode_1.get("phase_bytes"),
        "decode_1_phase_read_gbs": decode_1.get("phase_read_gbs"),
        "decode_1_lm_head_alone_gbs": decode_1.get("lm_head_alone_gbs"),
        "decode_1_preempted_per_step": decode_1["preempted_per_step"],
        "rss_bytes": summary["rss_bytes"],
        "rss_of_file": summary.get("rss_of_file"),
    }


def peer_round(gguf: Path, threads: int, probe) -> dict:
    bins = llamacpp.ensure_built()
    prefill = llamacpp.bench_prefill(gguf, 512, threads, reps=1, bin_dir=bins)["tok_s"]
    before = probe.gbs()
    decode_1 = llamacpp.bench_decode(gguf, threads, 64, reps=1, bin_dir=bins)["tok_s"]
    after = probe.gbs()
    return {
        "prefill_512": prefill,
        "decode_1": decode_1,
        "decode_32": llamacpp.bench_batched(gguf, 32, threads=threads, bin_dir=bins)["tok_s"],
        "decode_1_read_probe_gbs": [before, after],
    }


def lm_head_rate(ours: dict) -> list[float]:
    """cpud's LM head read alone (GB/s), where measured: a second sign of the period."""
    lm_head = ours.get("decode_1_lm_head_alone_gbs")
    return [lm_head] if lm_head else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path)
    ap.add_argument("--quant", default="Q4_K_M")
    ap.add_argument(
        "--preset",
        choices=("qwen3-30b-a3b-6l", "gpt-oss-20b-4l"),
        default="qwen3-30b-a3b-6l",
        help="the fixture made into the file (gpt-oss-20b-4l: MXFP4 experts; --quant unused)",
    )
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/moe-bench"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    gguf = args.gguf
    if gguf is None and args.preset == "gpt-oss-20b-4l":
        from bench_moe_gptoss import make_gpt_oss_gguf

        gguf = make_gpt_oss_gguf(args.workdir)
    if gguf is None:
        import bench_moe

        from cpud.fixtures import make_model

        source = args.workdir / f"qwen3_moe-{bench_moe.PRESET}"
        if not (source / "config.json").exists():
            make_model("qwen3_moe", bench_moe.PRESET, source, dtype="bfloat16")
        gguf = bench_moe.make_gguf(source, args.quant, args.workdir)
    import torch
    from bench_moe import ReadProbe

    torch.set_num_threads(args.threads)  # the probe on as many threads as both engines
    probe = ReadProbe(1024)
    rounds = []
    for i in range(args.rounds):
        peer = peer_round(gguf, args.threads, probe)
        ours = cpud_round(gguf, args.threads, args.steps)
        ratio = {k: ours[k] / peer[k] for k in ("prefill_512", "decode_1", "decode_32")}
        spread = mixed(
            [*peer["decode_1_read_probe_gbs"], ours["read_probe_gbs"], *lm_head_rate(ours)]
        )
        rounds.append({"llama.cpp": peer, "cpud": ours, "ratio": ratio, "mixed_periods": spread})
        print(json.dumps({"round": i + 1, **rounds[-1]}), flush=True)
    result = {"gguf": str(gguf), "bytes": gguf.stat().st_size, "threads": args.threads}
    result["rounds"] = rounds
    result["decode_1_by_period"] = paired_by_period(
        {
            "cpud": [(r["cpud"]["decode_1"], [r["cpud"]["read_probe_gbs"]]) for r in rounds],
            "llama.cpp": [
                (r["llama.cpp"]["decode_1"], r["llama.cpp"]["decode_1_read_probe_gbs"])
                for r in rounds
            ],
        }
    )
    print(json.dumps({"decode_1_by_period": result["decode_1_by_period"]}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
