"""perf/bench_moe_gptoss.py's streamed gpt-oss GGUF writer (the perf file of gpt-oss-20b's shape)
writes what tests/test_gpt_oss_gguf.py's writer writes (checked there against transformers):
the same tensors by name, MXFP4 expert blocks byte for byte, F32 norms / biases / sinks / router
as they are, the other matrices as their values rounded to bf16."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from test_gpt_oss_gguf import write_gpt_oss_gguf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "perf"))

from bench_moe_gptoss import mxfp4_blocks  # noqa: E402
from bench_moe_gptoss import write_gpt_oss_gguf as write_streamed  # noqa: E402


def _tensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    reader = gguf.GGUFReader(str(path))
    return {t.name: (t.tensor_type.name, np.array(t.data)) for t in reader.tensors}


def test_mxfp4_blocks_round_as_gguf_py():
    values = torch.randn(4, 256) * 0.02
    values[0, :32] = 0
    # midpoints between E2M1 values at the block's scale (amax 12/8 -> d = 1/8): ties
    values[1, :16] = torch.tensor(
        [0.5, 1.5, 2.5, 3.5, 5, 7, 10, -0.5, -1.5, -10, 12, -12, 0, 3, 1, 6]
    )
    values[1, :16] /= 16
    want = gguf.quants.quantize(values.numpy(), T.MXFP4)
    assert np.array_equal(mxfp4_blocks(values), want)


def test_streamed_file_equals_the_converter_layout(model_factory, tmp_path):
    model_dir = model_factory("gpt_oss")
    write_gpt_oss_gguf(model_dir, tmp_path / "ref.gguf", T.MXFP4, T.F32)
    reference = _tensors(tmp_path / "ref.gguf")
    ours = _tensors(write_streamed(model_dir, tmp_path / "ours.gguf", "BF16"))
    assert ours.keys() == reference.keys()
    kinds = set()
    for name, (qtype, data) in ours.items():
        ref_type, ref = reference[name]
        if ref_type == "MXFP4" or qtype == "F32":
            assert (qtype, data.tobytes()) == (ref_type, ref.tobytes()), name
            kinds.add(qtype)
            continue
        assert qtype == "BF16", name
        rounded = torch.from_numpy(ref).to(torch.bfloat16).view(torch.uint8).numpy()
        assert np.array_equal(data.view(np.uint8).reshape(rounded.shape), rounded), name
        kinds.add(qtype)
    assert kinds == {"MXFP4", "F32", "BF16"}
    assert ours["blk.0.ffn_gate_inp.weight"][0] == "F32"
