"""Requantize a GGUF file's quantized tensors to another type (perf only): a target model for
draft-model speculation that shares the draft's tokenizer, e.g. the default model's Q4_1 file
drafting for a Q8_0 (or F16 / BF16) copy of itself.

    python perf/requantize_gguf.py --out /tmp/smollm2-q8_0.gguf [--src FILE] [--type Q8_0]

Every quantized tensor is dequantized with gguf-py and quantized again to --type; F32 tensors
(norms) and every metadata key are copied as they are, general.file_type set to match. The
copy's weights are the source's values as --type holds them (Q8_0 of Q4_1 values is close to
exact): the same model, more bytes read per token. The default --src is the default model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import LlamaFileType
from gguf.quants import dequantize, quantize

TARGETS = {
    "Q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "F16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "BF16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16),
}
KEPT = (GGMLQuantizationType.F32,)  # stored as they are


def copy_metadata(reader: GGUFReader, writer: GGUFWriter, file_type: int) -> None:
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the writer writes these itself
        if field.name == "general.file_type":
            writer.add_file_type(file_type)
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_type)


def requantized(data: np.ndarray, source: GGMLQuantizationType, target: GGMLQuantizationType):
    """The tensor's bytes (or values) in the target type."""
    values = dequantize(data, source)
    if target == GGMLQuantizationType.F16:
        return values.astype(np.float16)
    return quantize(values, target)


def requantize(src: Path, out: Path, target: str) -> Path:
    qtype, file_type = TARGETS[target]
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(out, arch)
    copy_metadata(reader, writer, int(file_type))
    for tensor in reader.tensors:
        if tensor.tensor_type in KEPT:
            writer.add_tensor(tensor.name, np.asarray(tensor.data))
            continue
        data = requantized(np.asarray(tensor.data), tensor.tensor_type, qtype)
        raw_dtype = None if qtype == GGMLQuantizationType.F16 else qtype
        writer.add_tensor(tensor.name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", type=Path, default=None, help="GGUF file (default: default model)")
    parser.add_argument("--out", type=Path, required=True, help="the requantized file to write")
    parser.add_argument("--type", default="Q8_0", choices=sorted(TARGETS))
    args = parser.parse_args(argv)
    src = args.src
    if src is None:
        from cpud.model.default_model import default_model_path

        src = default_model_path()
    if args.out.resolve() == Path(src).resolve():
        sys.exit("--out must differ from --src")
    requantize(Path(src), args.out, args.type)
    print(f"{args.out}: {args.out.stat().st_size / 1e6:.1f} MB ({args.type} from {src})")


if __name__ == "__main__":
    main()
