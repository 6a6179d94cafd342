"""GGUF files for perf/bench_serving.py: cpud and llama-server serve the same quantized file.

`--quantized Q8_0 Q4_K_M` makes the files as perf/bench_quant_peer.py does (the --preset qwen3
fixture converted to a bf16 GGUF by llama.cpp's converter, then llama-quantize), `--gguf FILE`
takes files as they are. The servers read their tokenizer from the file; aiperf needs a
Hugging Face tokenizer directory: the fixture directory the file was converted from (or
--tokenizer). Also the Markdown table of the results and perf/suite.py's rows for them.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "peers"))

# Issue #22: serving 32 concurrent >= 1.3x llama.cpp output tok/s, with a lower TTFT p99.
SERVING_RATIO = 1.3
SERVING_TEXT = f">= {SERVING_RATIO}x llama.cpp output tok/s and lower TTFT p99"
REPACK_OFF_NOTE = "--no-repack: weight repacking off"


@dataclass(frozen=True)
class GgufFile:
    """One file both servers load, its type, and the tokenizer directory aiperf reads."""

    path: Path
    qtype: str
    tokenizer: Path


def file_type(path: Path) -> str:
    """The file's weight type as llama.cpp names it (general.file_type: Q8_0, Q4_K_M, ...)."""
    import gguf

    from cpud.model.gguf_file import field_value, open_gguf

    code = field_value(open_gguf(path), "general.file_type", None)
    if code is None:
        return "unknown"
    try:
        return gguf.LlamaFileType(int(code)).name.removeprefix("MOSTLY_")
    except ValueError:
        return f"file_type {code}"


def given_files(paths: list[Path], tokenizer: Path) -> list[GgufFile]:
    """--gguf FILE ...; ValueError (one line) for a file that is not a readable GGUF file."""
    from cpud.settings.errors import ConfigError

    out = []
    for path in paths:
        path = path.expanduser()
        try:
            out.append(GgufFile(path, file_type(path), tokenizer))
        except ConfigError as exc:
            raise ValueError(f"--gguf {path}: {exc}") from None
    return out


def quantized_files(types: list[str], preset: str) -> list[GgufFile]:
    """One llama-quantize output per type of the qwen3 `preset` fixture, made (or found in the
    cache) exactly as perf/bench_quant_peer.py makes them."""
    import llamacpp
    from bench_quant_peer import files

    made = files(types, llamacpp.default_cache_dir(), preset)
    fixture = llamacpp.resolve_model(None, "qwen3", preset)
    return [GgufFile(made[qtype], qtype, fixture) for qtype in types]


def gguf_files(args: Any) -> list[GgufFile]:
    """The --quantized and --gguf files (each once); exit 2 with one line for a bad type or
    file."""
    import gguf
    from llamacpp import resolve_model
    from serving_server import one_line

    try:
        unknown = [t for t in args.quantized if f"MOSTLY_{t}" not in gguf.LlamaFileType.__members__]
        if unknown:
            raise ValueError(f"--quantized {unknown[0]}: not a llama.cpp type (Q8_0, Q4_K_M, ...)")
        missing = [path for path in args.gguf if not path.expanduser().is_file()]
        if missing:
            raise ValueError(f"--gguf {missing[0]}: no such file")
        tokenizer = args.tokenizer
        if args.gguf and tokenizer is None:
            tokenizer = resolve_model(args.model, args.arch, args.preset)
        found = given_files(args.gguf, tokenizer)
    except ValueError as exc:
        print(f"bench_serving.py: error: {exc}", file=sys.stderr)
        sys.exit(2)
    try:
        made = quantized_files(args.quantized, args.preset) if args.quantized else []
    except Exception as exc:
        types = " ".join(args.quantized)
        sys.exit(one_line(f"bench_serving.py: cannot make the {types} files: {exc}"))
    return list({str(f.path): f for f in [*made, *found]}.values())


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def number(value: float | None, form: str, scale: float = 1) -> str:
    """`form` of value * scale; 'n/a' for a figure the load generator did not give."""
    return "n/a" if value is None else form.format(scale * value)


def figures(r: dict[str, Any]) -> str:
    """One run's figures on one line."""
    ttft = f"{number(r['ttft_p50_s'], '{:.2f}')}/{number(r['ttft_p99_s'], '{:.2f}')} s"
    itl = number(r["itl_p50_s"], "{:.0f} ms", 1000)
    return (
        f"{number(r['output_tok_s'], '{:.1f}')} tok/s, TTFT p50/p99 {ttft}, ITL p50 {itl} "
        f"({r['loadgen']})"
    )


def ratio_cell(row: dict[str, Any], key: str, peer: str) -> str:
    """'1.32x (1.30, 1.35)': the median of the per-round ratios, then each round's."""
    median = row.get(f"ratio_{key}_vs_{peer}")
    if median is None:
        return ""
    rounds = row.get(f"ratios_{key}_vs_{peer}", [])
    each = f" ({', '.join(f'{r:.2f}' for r in rounds)})" if len(rounds) > 1 else ""
    return f"{median:.2f}x{each}"


def table(
    rows: dict[str, dict[str, Any]],
    names: list[str],
    status: dict[str, str],
    repack_off: dict[str, str],
    lead: tuple[str, ...] = (),
) -> list[str]:
    """Markdown rows, one per concurrency and target; `lead` cells (file, type) start each."""
    lines = []
    for conc, row in rows.items():
        for name in names:
            shown = f"{name} ({REPACK_OFF_NOTE})" if name in repack_off else name
            cells = [*lead, conc, shown]
            if name not in row:
                lines.append("| " + " | ".join([*cells, status.get(name, "not run")]) + " | |" * 6)
                continue
            r = row[name]
            cells += [
                number(r["output_tok_s"], "{:.1f}"),
                number(r["request_s"], "{:.3f}"),
                number(r["ttft_p50_s"], "{:.2f} s"),
                number(r["ttft_p99_s"], "{:.2f} s"),
                number(r["itl_p50_s"], "{:.0f} ms", 1000),
                ratio_cell(row, "output_tok_s", name),
                ratio_cell(row, "ttft_p99_s", name),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def table_head(lead: tuple[str, ...] = ()) -> list[str]:
    cols = [*lead, "concurrency", "target", "output tok/s", "requests/s", "TTFT p50", "TTFT p99"]
    cols += ["ITL p50", "cpud/peer tok/s (per round)", "cpud/peer TTFT p99 (per round)"]
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]


def files_markdown(summary: dict[str, Any], names: list[str]) -> list[str]:
    """The table of a --gguf / --quantized run: one row per file, concurrency and target."""
    lead = ("file", "type")
    lines = table_head(lead)
    for label, entry in summary["files"].items():
        cells = (Path(label).name, entry["type"])
        lines += table(entry["concurrency"], names, entry["targets"], entry["repack_off"], cells)
    lines += ["", "Files and commands:"]
    for label, entry in summary["files"].items():
        lines.append(f"- {label} ({entry['type']}; aiperf tokenizer {entry['tokenizer']})")
        lines += [f"  - {name}: `{cmd}`" for name, cmd in entry["commands"].items()]
        lines += [
            f"  - {name} crashed with weight repacking on, so it ran with it off: {why}"
            for name, why in entry["repack_off"].items()
        ]
    return lines


def suite_targets(types: tuple[str, ...] = ("Q8_0", "Q4_K_M")) -> dict[str, dict[str, Any]]:
    """perf/suite.py's TARGETS entries of the quantized serving rows."""
    return {
        f"{qtype} serving-32": {"peer": "llama.cpp", "ratio": SERVING_RATIO, "text": SERVING_TEXT}
        for qtype in types
    }


def suite_rows(data: dict[str, Any] | None, err: str) -> dict[str, dict[str, Any]]:
    """perf/suite.py's rows `<type> serving-<concurrency>`: medians, the median of the per-round
    ratios (output tok/s and TTFT p99), and every round's ratio in the note."""
    if not data or not data.get("files"):
        return {"quantized-serving": {"unit": "output tok/s", "error": err}}
    rows: dict[str, dict[str, Any]] = {}
    for label, entry in data["files"].items():
        for conc, src in entry["concurrency"].items():
            key = f"{entry['type']} serving-{conc}"
            if "cpud" not in src:
                rows[key] = {"unit": "output tok/s", "error": entry["targets"].get("cpud", err)}
                continue
            row: dict[str, Any] = {
                "unit": "output tok/s",
                "cpud": src["cpud"]["output_tok_s"],
                "cpud_detail": src["cpud"],
                "loadgen": data.get("loadgen"),
                "peers": {},
            }
            notes = [f"{Path(label).name}"]
            for peer, status in entry["targets"].items():
                if peer == "cpud":
                    continue
                if peer not in src:
                    row["peers"][peer] = {"status": status if status != "ok" else "not measured"}
                    continue
                row["peers"][peer] = {
                    "value": src[peer]["output_tok_s"],
                    "ratio": src.get(f"ratio_output_tok_s_vs_{peer}"),
                    "ttft_p99_ratio": src.get(f"ratio_ttft_p99_s_vs_{peer}"),
                    "detail": src[peer],
                }
                per_round = src.get(f"ratios_output_tok_s_vs_{peer}", [])
                ttft = src.get(f"ratios_ttft_p99_s_vs_{peer}", [])
                notes.append(
                    f"cpud/{peer} per round: tok/s "
                    + ", ".join(f"{x:.2f}x" for x in per_round)
                    + "; TTFT p99 "
                    + ", ".join(f"{x:.2f}x" for x in ttft)
                )
                if peer in entry["repack_off"]:
                    notes.append(f"{peer} ran with {REPACK_OFF_NOTE}")
            row["note"] = "; ".join(notes)
            rows[key] = row
    return rows
