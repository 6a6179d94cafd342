"""cpud against llama.cpp on the same quantized GGUF files, interleaved rounds.

The qwen3-0.6b-shaped fixture is converted to a bf16 GGUF by llama.cpp's converter, then
quantized by llama-quantize to each type asked (Q8_0, Q4_K_M); cpud serves the SAME files
(--quantization auto). Each round runs cpud then llama.cpp on one file (A B A B ...) and
reports the ratio of that round: decode 1 stream (cpud t(129) - t(1); llama-bench tg128),
decode 32 streams (output tok/s; llama-batched-bench S_TG), prefill 512. cpud's own bf16
decode-1 on the bf16 GGUF gives the "quantized vs own bf16" ratio.

Each engine's decode 1 is bracketed by the read probe (perf/read_periods.py): a round whose
readings spread past 1.25x is marked "mixed_periods", and "decode_1_by_period" compares the
engines within one memory-read period of the host (slow / fast, or one).

    python perf/bench_quant_peer.py --rounds 3 --json perf/results/quant_peer.json
    python perf/bench_quant_peer.py --quick     # one round, short runs: checks the plumbing
    python perf/bench_quant_peer.py --preset llama-3.2-1b --decode-1-only   # a larger file
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))

import llamacpp  # noqa: E402
from read_periods import ProbeProcess, bracketed, mixed, paired_by_period  # noqa: E402

# Issue #22's targets against llama.cpp on each file, and against cpud's own bf16.
PEER_TARGETS = {"decode-1": 1.3, "decode-32": 1.3, "prefill-512": 1.2}
OWN_BF16_TARGET = {"Q4_K_M": 2.5}


def suite_targets(types: tuple[str, ...] = ("Q8_0", "Q4_K_M")) -> dict[str, dict[str, Any]]:
    """perf/suite.py's TARGETS entries of the quantized rows."""
    out: dict[str, dict[str, Any]] = {}
    for qtype in types:
        for name, ratio in PEER_TARGETS.items():
            text = f">= {ratio}x llama.cpp"
            out[f"{qtype} {name}"] = {"peer": "llama.cpp", "ratio": ratio, "text": text}
        if qtype in OWN_BF16_TARGET:
            ratio = OWN_BF16_TARGET[qtype]
            out[f"{qtype} decode-1 vs own bf16"] = {"ratio": ratio, "text": f">= {ratio}x"}
    return out


def suite_rows(data: dict[str, Any] | None, err: str) -> dict[str, dict[str, Any]]:
    """perf/suite.py's rows: per type and figure the medians, the median of the per-round
    ratios, and every round's ratio in the note."""
    if not data or not data.get("types"):
        return {"quantized": {"unit": "tok/s", "error": err}}
    rows: dict[str, dict[str, Any]] = {}
    for qtype, entry in data["types"].items():
        rounds = entry["rounds"]
        for key in (k for k, v in rounds[0]["cpud"].items() if isinstance(v, float)):
            ratios = [r["ratio"][key] for r in rounds if key in r["ratio"]]
            theirs = [r["llama.cpp"][key] for r in rounds if r["llama.cpp"][key]]
            peer = {"status": "failed (see quantized.log)"}
            if theirs and ratios:
                peer = {"value": statistics.median(theirs), "ratio": statistics.median(ratios)}
            rows[f"{qtype} {key.replace('_', '-')}"] = {
                "unit": "tok/s",
                "cpud": statistics.median(r["cpud"][key] for r in rounds),
                "peers": {"llama.cpp": peer},
                "note": f"{qtype} GGUF, ratio per round "
                + (", ".join(f"{x:.2f}x" for x in ratios) or "none"),
            }
        own = entry["vs_own_bf16_decode_1"]
        rows[f"{qtype} decode-1 vs own bf16"] = {
            "unit": "x",
            "cpud": own,
            "ratio": own,
            "peers": {},
        }
    return rows


def cpud_llm(path: Path, quantization: str) -> Any:
    from cpud import LLM, SamplingParams

    # No prefix cache: every round sends the same prompts, and a hit would skip the prefill.
    llm = LLM(
        path,
        dtype="bfloat16",
        quantization=quantization,
        max_num_seqs=32,
        enable_prefix_caching=False,
    )
    llm.generate([[7, 8, 9]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm up
    return llm


def cpud_round(llm: Any, gen: int, streams: int, prompt: int, probe: Any) -> dict[str, Any]:
    from cpud import SamplingParams

    def timed(prompts: list[list[int]], tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - t0

    one = [list(range(7, 15))]
    decode_1, readings = bracketed(
        probe, lambda: gen / max(1e-9, timed(one, gen + 1) - timed(one, 1))
    )
    out = {}
    if streams:
        many = [[7 + s, *range(20, 51)] for s in range(streams)]
        out[f"decode_{streams}"] = streams * gen / timed(many, gen)
        out[f"prefill_{prompt}"] = prompt / timed([list(range(7, 7 + prompt))], 1)
    # decode_1 last: with streams == 1 the two keys are one, and decode 1 is the figure meant
    return {**out, "decode_1": decode_1, "decode_1_read_probe_gbs": readings}


def llamacpp_round(
    path: Path, gen: int, streams: int, prompt: int, no_repack: set[str], probe: Any
) -> dict[str, Any]:
    """llama.cpp's figures; a tool that crashes with weight repacking (its fastest kernels) is
    run again without it, and its key joins no_repack; None for one that fails both ways."""

    def tok_s(key: str, run: Any) -> float | None:
        for repack in (True, False):
            if repack and key in no_repack:
                continue
            try:
                return run(repack)["tok_s"]
            except (subprocess.CalledProcessError, RuntimeError, ValueError) as exc:
                print(f"llama.cpp failed (repack {repack}): {exc}", file=sys.stderr)
                no_repack.add(key)
        return None

    decode_1, readings = bracketed(
        probe,
        lambda: tok_s(
            "decode_1", lambda rp: llamacpp.bench_decode(path, n_gen=gen, reps=1, repack=rp)
        ),
    )
    out = {"decode_1": decode_1, "decode_1_read_probe_gbs": readings}
    if not streams:
        return out
    return {
        **out,
        f"decode_{streams}": tok_s(
            f"decode_{streams}",
            lambda rp: llamacpp.bench_batched(path, streams, n_prompt=32, n_gen=gen, repack=rp),
        ),
        f"prefill_{prompt}": tok_s(
            f"prefill_{prompt}",
            lambda rp: llamacpp.bench_prefill(path, n_prompt=prompt, reps=1, repack=rp),
        ),
    }


def figures(streams: int, prompt: int) -> tuple[str, ...]:
    """The figures a round gives; streams 0: decode 1 alone."""
    return ("decode_1", f"decode_{streams}", f"prefill_{prompt}") if streams else ("decode_1",)


def files(types: list[str], cache: Path, preset: str) -> dict[str, Path]:
    """The bf16 GGUF of the preset's fixture and one llama-quantize output per type."""
    model_dir = llamacpp.preset_model(preset)
    bf16 = llamacpp.convert(model_dir, llamacpp.gguf_path(model_dir, "bf16"))
    out = {"BF16": bf16}
    for qtype in types:
        out[qtype] = llamacpp.quantize(bf16, cache / "gguf" / f"{bf16.stem}.{qtype}.gguf", qtype)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--types", nargs="+", default=["Q8_0", "Q4_K_M"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 round, 16 tokens, 8 streams")
    parser.add_argument(
        "--preset", default="qwen3-0.6b", help="the fixture's shape (qwen3-0.6b, llama-3.2-1b)"
    )
    parser.add_argument(
        "--decode-1-only", action="store_true", help="no decode 32 / prefill 512 figures"
    )
    parser.add_argument("--json", type=Path, default=HERE / "results" / "quant_peer.json")
    args = parser.parse_args(argv)
    gen, streams, prompt, rounds = (16, 8, 128, 1) if args.quick else (128, 32, 512, args.rounds)
    streams = 0 if args.decode_1_only else streams
    paths = files(args.types, llamacpp.default_cache_dir(), args.preset)
    probe = ProbeProcess()
    own = cpud_llm(paths["BF16"], "none")
    bf16_decode = [cpud_round(own, gen, 1, 8, probe)["decode_1"] for _ in range(rounds)]
    own.shutdown()
    results: dict[str, Any] = {"cpud_bf16_decode_1": bf16_decode, "types": {}}
    for qtype in args.types:
        llm = cpud_llm(paths[qtype], "auto")
        per_round = []
        no_repack: set[str] = set()
        for r in range(rounds):
            ours = cpud_round(llm, gen, streams, prompt, probe)
            theirs = llamacpp_round(paths[qtype], gen, streams, prompt, no_repack, probe)
            ratios = {k: ours[k] / theirs[k] for k in figures(streams, prompt) if theirs[k]}
            readings = ours["decode_1_read_probe_gbs"] + theirs["decode_1_read_probe_gbs"]
            per_round.append({"cpud": ours, "llama.cpp": theirs, "ratio": ratios})
            per_round[-1]["mixed_periods"] = mixed(readings)
            print(
                f"{qtype} round {r + 1}: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
            )
        llm.shutdown()
        own_ratio = statistics.median(p["cpud"]["decode_1"] for p in per_round) / statistics.median(
            bf16_decode
        )
        print(f"{qtype}: cpud decode-1 vs cpud bf16 {own_ratio:.2f}x")
        by_period = paired_by_period(
            {
                engine: [
                    (p[engine]["decode_1"], p[engine]["decode_1_read_probe_gbs"])
                    for p in per_round
                    if p[engine]["decode_1"]
                ]
                for engine in ("cpud", "llama.cpp")
            }
        )
        print(f"{qtype} decode 1 by period: {json.dumps(by_period)}")
        results["types"][qtype] = {
            "rounds": per_round,
            "decode_1_by_period": by_period,
            "vs_own_bf16_decode_1": own_ratio,
            "llama.cpp without repacking": sorted(no_repack),
        }
    probe.close()
    results["loadavg"] = llamacpp.loadavg()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
