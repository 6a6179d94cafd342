"""The gpt-oss-20b-4l fixture (gpt-oss-20b's shape, 4 of its 24 layers) as a GGUF file the way
llama.cpp's converter writes gpt-oss (GptOssModel; tests/test_gpt_oss_gguf.py writes the same
layout from the tiny fixture): experts in MXFP4 as ffn_gate_exps / ffn_up_exps [E, I, H] and
ffn_down_exps [E, H, I] with F32 biases, the router as an F32 ffn_gate_inp with its bias,
attn_sinks, the other matrices in BF16 (the converter's outtype for a bf16 checkpoint) or Q8_0.
Written one tensor at a time (the fixture is about 9 GB in bf16), MXFP4 rounded as gguf-py's
quantizer rounds, in torch.

    python perf/bench_moe_gptoss.py [--workdir /tmp/moe-bench] [--dense BF16]   # its path
    python perf/bench_moe_check.py --gguf FILE        # cpud and llama.cpp read it alike
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch

from cpud.fixtures.archs.gpt_oss import llama_cpp_expert_parts, llama_cpp_name

HERE = Path(__file__).resolve().parent
PRESET = "gpt-oss-20b-4l"
DENSE_TYPES = ("BF16", "Q8_0")
# Midpoints between the doubled E2M1 magnitudes 0, 1, 2, 3, 4, 6, 8, 12 (codes 0-7; 8-15: -)
_MIDPOINTS = torch.tensor([0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 10.0])


def mxfp4_blocks(w: torch.Tensor, chunk: int = 1 << 16) -> np.ndarray:
    """w [rows, K] (K % 32 == 0) as MXFP4 blocks [rows, K / 32 * 17] u8, rounded as gguf-py's
    MXFP4.quantize_blocks rounds (E8M0 scale floor(log2 amax) - 2, each value to the nearest
    E2M1 code, the first on a tie)."""
    rows, k = w.shape
    blocks = w.to(torch.float32).reshape(-1, 32)
    out = np.empty((blocks.shape[0], 17), dtype=np.uint8)
    for b0 in range(0, blocks.shape[0], chunk):
        x = blocks[b0 : b0 + chunk]
        amax = x.abs().amax(dim=1)
        e = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2 + 127, 0).to(torch.uint8)
        # ggml_e8m0_to_fp32_half: 2^(e - 128), denormal below e = 2
        ei = e.to(torch.int32)
        bits = torch.where(ei < 2, 0x00200000 << ei, (ei - 1) << 23)
        d = bits.view(torch.float32)
        # the nearest of 0, 1, 2, 3, 4, 6, 8, 12 to |x| / d (exact: d is a power of two), the
        # smaller on a tie; a negative value's code is 8 above its magnitude's, but for 0
        q = torch.bucketize(x.abs() / d[:, None], _MIDPOINTS)
        codes = torch.where((x < 0) & (q > 0), q + 8, q).to(torch.uint8)
        qs = codes[:, :16] | (codes[:, 16:] << 4)
        out[b0 : b0 + chunk, 0] = e.numpy()
        out[b0 : b0 + chunk, 1:] = qs.numpy()
    return out.reshape(rows, k // 32 * 17)


def _dense(values: torch.Tensor, dense: str) -> tuple[np.ndarray, str]:
    if dense == "BF16":
        return values.to(torch.bfloat16).view(torch.uint8).numpy(), "BF16"
    import gguf

    quantized = gguf.quants.quantize(
        values.to(torch.float32).numpy(), gguf.GGMLQuantizationType.Q8_0
    )
    return quantized, "Q8_0"


def _tensors(
    shards: list, dense: str
) -> Iterator[tuple[str, Callable[[], tuple[np.ndarray, str]]]]:
    """(GGUF name, a function giving its data and type) of every tensor of the open shards."""
    for f in shards:
        for hf in f.keys():
            yield from _converted(f, hf, dense)


def _converted(
    f, hf: str, dense: str
) -> Iterator[tuple[str, Callable[[], tuple[np.ndarray, str]]]]:
    parts = llama_cpp_expert_parts(hf)
    if parts is None:

        def plain(hf=hf):
            values = f.get_tensor(hf)
            if values.dim() == 2 and ".mlp.router." not in hf:  # the router stays F32
                return _dense(values, dense)
            return values.to(torch.float32).numpy(), "F32"

        yield llama_cpp_name(hf), plain
        return
    for name, start in parts:

        def part(hf=hf, start=start):
            values = f.get_tensor(hf)
            if hf.endswith("_bias"):  # F32 [E, rows]; gate and up interleaved
                values = values if start is None else values[:, start::2]
                return np.ascontiguousarray(values.to(torch.float32).numpy()), "F32"
            rows = values.transpose(1, 2)  # [E, out, in]
            rows = rows if start is None else rows[:, start::2]
            return np.stack([mxfp4_blocks(w.contiguous()) for w in rows]), "MXFP4"

        yield name, part


def write_gpt_oss_gguf(model_dir: Path, path: Path, dense: str = "BF16") -> Path:
    """model_dir (the gpt_oss fixture) as a GGUF file at path (see the module doc)."""
    import gguf
    from safetensors import safe_open

    sys.path.insert(0, str(HERE.parent / "tests"))
    from gguf_vocab import add_tokenizer_metadata
    from gguf_writer import _set_parameters

    if dense not in DENSE_TYPES:
        raise SystemExit(f"--dense {dense}: choose one of {', '.join(DENSE_TYPES)}")
    config = json.loads((model_dir / "config.json").read_text())
    partial = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(partial), "gpt-oss")
    file_type = (
        gguf.LlamaFileType.MOSTLY_BF16 if dense == "BF16" else gguf.LlamaFileType.MOSTLY_Q8_0
    )
    _set_parameters(writer, "gpt-oss", config, file_type)
    add_tokenizer_metadata(writer, model_dir, kind="gpt2", pre="gpt-4o")
    with ExitStack() as stack:
        files = sorted(model_dir.glob("model*.safetensors"))
        shards = [stack.enter_context(safe_open(str(f), framework="pt")) for f in files]
        _write(writer, list(_tensors(shards, dense)), _byte_shapes(model_dir, dense))
    partial.rename(path)
    return path


def _write(writer, tensors: list, shapes: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """The header (every tensor's type and size, from the checkpoint's shapes), then each
    tensor's data as it is made."""
    import gguf

    for name, _ in tensors:
        shape, qtype = shapes[name]
        writer.add_tensor_info(
            name,
            shape,
            np.dtype(np.uint8 if qtype != "F32" else np.float32),
            int(np.prod(shape)) * (4 if qtype == "F32" else 1),
            gguf.GGMLQuantizationType[qtype] if qtype != "F32" else None,
        )
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, make in tensors:
        data, qtype = make()
        if tuple(data.shape) != shapes[name][0] or qtype != shapes[name][1]:
            raise RuntimeError(f"{name}: {data.shape} {qtype}, announced {shapes[name]}")
        writer.write_tensor_data(data)
    writer.close()


def _byte_shapes(model_dir: Path, dense: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """GGUF name -> (shape of the data as written: bytes for quantized, values for F32; type)."""
    from safetensors import safe_open

    out = {}
    for shard in sorted(model_dir.glob("model*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for hf in f.keys():
                shape = tuple(f.get_slice(hf).get_shape())
                parts = llama_cpp_expert_parts(hf)
                if parts is None:
                    name = llama_cpp_name(hf)
                    if len(shape) == 2 and ".mlp.router." not in hf:
                        per = {"BF16": shape[1] * 2, "Q8_0": shape[1] // 32 * 34}[dense]
                        out[name] = ((shape[0], per), dense)
                    else:
                        out[name] = (shape, "F32")
                    continue
                for name, start in parts:
                    if hf.endswith("_bias"):
                        rows = shape[1] if start is None else shape[1] // 2
                        out[name] = ((shape[0], rows), "F32")
                        continue
                    e, k, n = shape  # [E, in, out]
                    rows = n if start is None else n // 2
                    out[name] = ((e, rows, k // 32 * 17), "MXFP4")
    return out


def make_gpt_oss_gguf(workdir: Path, dense: str = "BF16") -> Path:
    """The fixture (made once in workdir) as a GGUF file (made once), see the module doc."""
    from cpud.fixtures import make_model

    source = workdir / f"gpt_oss-{PRESET}"
    if not (source / "config.json").exists() or not list(source.glob("model*.safetensors")):
        make_model("gpt_oss", PRESET, source, dtype="bfloat16")
    out = workdir / f"{source.name}-MXFP4-{dense}.gguf"
    return out if out.exists() else write_gpt_oss_gguf(source, out, dense)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/moe-bench"))
    ap.add_argument("--dense", choices=DENSE_TYPES, default="BF16")
    args = ap.parse_args()
    print(make_gpt_oss_gguf(args.workdir, args.dense))


if __name__ == "__main__":
    main()
