"""GGUF files whose expert layers stack gate and up in one blk.N.ffn_gate_up_exps [E, 2 I, H]
(gate rows, then up rows: what llama.cpp's converter writes under --fuse-gate-up-exps) load
like the file with separate ffn_gate_exps / ffn_up_exps: kept in their blocks, each rank taking
its rows of each half, the same logits bit for bit."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from family_checks import prompt_of
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from test_gguf_quantized import prefill_logits, runner
from test_gpt_oss_gguf import write_gpt_oss_gguf
from test_moe_gguf_quant import (  # noqa: F401 (quant_moe: a fixture)
    one_torch_thread,
    quant_moe,
    stack_types,
    tp_logits,
)
from test_tp_sharding import logits_with

from cpud.model.gguf_model import check_gguf_split, read_gguf_model
from cpud.model.load import load_model_config
from cpud.placement.memory_plan import quantized_weight_bytes
from cpud.ranks.model_runner import ModelRunner, RunnerConfig
from cpud.ranks.parallel import SingleRank
from cpud.settings.errors import ConfigError

# Q4_K gate/up rows (256 columns a block) and Q8_0 down: --tp 2 splits down in whole blocks
ARCH, PRESET, MIX = "qwen3_moe", "qwen3-moe-256", "Q4_K+Q8_0"


def fuse_gate_up_exps(source: Path, out: Path, keep_gate: bool = False) -> Path:
    """A copy of the GGUF file `source` with each layer's gate and up expert stacks written as
    one ffn_gate_up_exps of their blocks, gate rows first, and their biases (if any) as one
    ffn_gate_up_exps.bias [E, 2 I] (`keep_gate`: the gate stack and bias too)."""
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == V.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    tensors = {t.name: t for t in reader.tensors}
    for name, tensor in tensors.items():
        stem, _, kind = name.rpartition("_exps.")  # kind: weight or bias
        if stem.endswith(".ffn_up"):
            continue
        data = tensor.data
        if stem.endswith(".ffn_gate"):  # [E, rows, row bytes] or a bias [E, rows]
            if keep_gate:
                writer.add_tensor(name, data, raw_dtype=tensor.tensor_type)
            up = tensors[f"{stem.removesuffix('gate')}up_exps.{kind}"].data
            data = np.concatenate([data, up], axis=1)
            name = f"{stem}_up_exps.{kind}"
        writer.add_tensor(name, np.ascontiguousarray(data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def assert_blocks_and_logits_equal(
    plain: Path, fused: Path, types: tuple[str, str], seed: int
) -> None:
    """The fused file's expert stacks stay in blocks of `types` (gate/up, down) and its bf16
    prefill logits are the separate file's, bit for bit."""
    prompt = prompt_of(24, seed=seed)
    got_runner = runner(fused, torch.bfloat16)
    assert stack_types(got_runner.model) == {types}
    want = prefill_logits(runner(plain, torch.bfloat16), prompt)
    torch.testing.assert_close(prefill_logits(got_runner, prompt), want, rtol=0, atol=0)


def torch_runner(path: Path) -> ModelRunner:
    """fp32 on the torch kernels: the experts dequantized at load."""
    config = RunnerConfig(path, torch.float32, 512, 16, 32, kernels="torch")
    return ModelRunner(config, load_model_config(path), SingleRank())


@pytest.fixture(scope="module")
def files(quant_moe, tmp_path_factory):  # noqa: F811 (the imported fixture)
    """(the file with separate gate and up stacks, the same file with them fused)."""
    path, _ = quant_moe(ARCH, PRESET, MIX)
    return path, fuse_gate_up_exps(path, tmp_path_factory.mktemp("fused") / "fused.gguf")


def test_fused_file_checks_and_names_its_stack(files):
    plain, fused = files
    names = set(read_gguf_model(fused).tensors)
    assert "blk.0.ffn_gate_up_exps.weight" in names and "blk.0.ffn_gate_exps.weight" not in names
    assert read_gguf_model(fused).config == read_gguf_model(plain).config
    check_gguf_split(read_gguf_model(fused), 2)
    cfg = read_gguf_model(plain).config
    plans = [quantized_weight_bytes(cfg, "bfloat16", 2, path, "auto") for path in files]
    assert plans[0] == plans[1]  # the memory plan counts the fused stack at its bytes too


def test_fused_experts_stay_in_blocks_and_equal_the_separate_file(files):
    assert_blocks_and_logits_equal(*files, ("Q4_K", "Q8_0"), seed=3)


@pytest.mark.slow
def test_fused_experts_read_dense_equal_the_separate_file(files):
    """The torch kernels dequantize each half's rows at load."""
    prompt = prompt_of(24, seed=3)
    dense = [prefill_logits(torch_runner(path), prompt) for path in files]
    torch.testing.assert_close(dense[1], dense[0], rtol=0, atol=0)


def test_fused_experts_tp2_equal_the_separate_file(files):
    """Each rank takes its intermediate rows of the gate half and of the up half."""
    plain, fused = files
    prompt = prompt_of(20, seed=2)
    with one_torch_thread():
        got, want = tp_logits(fused, prompt, 2), tp_logits(plain, prompt, 2)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_fused_and_separate_gate_of_one_layer_refused(files, tmp_path):
    plain, _ = files
    both = fuse_gate_up_exps(plain, tmp_path / "both.gguf", keep_gate=True)
    with pytest.raises(ConfigError, match=r"blk\.0\.ffn_gate_exps\.weight"):
        read_gguf_model(both)


@pytest.fixture(scope="module")
def gpt_oss_files(model_factory, tmp_path_factory):
    """expert type -> (a gpt-oss file, whose expert stacks carry biases, the same fused)."""
    root = tmp_path_factory.mktemp("gpt-oss-fused")
    made = {}

    def get(expert_type: T) -> tuple[Path, Path]:
        if expert_type not in made:
            plain = root / f"{expert_type.name}.gguf"
            write_gpt_oss_gguf(model_factory("gpt_oss"), plain, expert_type, T.F32)
            made[expert_type] = plain, fuse_gate_up_exps(plain, root / f"{plain.stem}-fused.gguf")
        return made[expert_type]

    return get


def test_fused_biases_in_blocks_equal_the_separate_file(gpt_oss_files):
    """gpt-oss's MXFP4 stacks with one ffn_gate_up_exps.bias: the gate and up halves of the
    bias land where the separate biases do."""
    plain, fused = gpt_oss_files(T.MXFP4)
    names = set(read_gguf_model(fused).tensors)
    assert "blk.0.ffn_gate_up_exps.bias" in names and "blk.0.ffn_gate_exps.bias" not in names
    cfg = read_gguf_model(plain).config
    plans = [quantized_weight_bytes(cfg, "bfloat16", 1, path, "auto") for path in (plain, fused)]
    assert plans[0] == plans[1]
    assert_blocks_and_logits_equal(plain, fused, ("MXFP4", "MXFP4"), seed=5)


def test_fused_biases_tp2_equal_the_separate_file(gpt_oss_files):
    """Each rank takes its columns of the gate half and of the up half of the fused bias (F32
    experts: the tiny fixture's 32 rows hold no whole block per rank)."""
    plain, fused = gpt_oss_files(T.F32)
    check_gguf_split(read_gguf_model(fused), 2)
    prompt = prompt_of(20, seed=2)
    with one_torch_thread():
        got, want = logits_with(fused, prompt, 2), logits_with(plain, prompt, 2)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
