"""Mixture-of-experts GGUF files (qwen3moe; llama with experts, i.e. Mixtral) written the way
llama.cpp's converter writes them: every expert of a layer in one [experts, rows, columns]
tensor per projection (ffn_gate_exps / ffn_up_exps / ffn_down_exps) and the router as
ffn_gate_inp. cpud loads them into the same expert layer, experts dequantized to the run dtype,
and matches transformers on the same (dequantized) weights."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf_vocab import add_tokenizer_metadata
from gguf_writer import _set_parameters, encode, gguf_name, permute
from safetensors.numpy import load_file, save_file

from cpud import LLM, SamplingParams
from cpud.settings.errors import ConfigError
from hf_reference import hf_greedy

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [(31 * i + 7) % 400 + 4 for i in range(40)]]
ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}
_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
    r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight"
)
_STACK = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down"}
_STACK["w2"] = "down"
_PARTS = ("gate", "up", "down")


def _dense_type(wanted: T | None, name: str, shape: tuple[int, ...]) -> T:
    """`wanted` for a 2-D weight whose rows are whole blocks of it, else Q8_0 where they are
    whole blocks of 32 (llama.cpp's fallback), else F32; the router and vectors F32."""
    if wanted is None or len(shape) != 2 or "ffn_gate_inp" in name:
        return T.F32
    for qtype in (wanted, T.Q8_0):
        if shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
            return qtype
    return T.F32


def write_moe_gguf(
    model_dir: Path,
    path: Path,
    expert_type: T | dict[str, T],
    dense_type: T | None = None,
    keep_values: bool = True,
) -> dict[str, np.ndarray]:
    """The fixture as a GGUF, expert stacks in expert_type (or per stack: {"gate", "up",
    "down": type}), the other matrices in dense_type where their rows are whole blocks of it
    (default: F32); returns each expert tensor as the file holds it (dequantized), by Hugging
    Face name, unless not keep_values.  Reads the checkpoint's shards one tensor at a time."""
    import torch
    from safetensors import safe_open

    types = expert_type if isinstance(expert_type, dict) else dict.fromkeys(_PARTS, expert_type)
    config = json.loads((model_dir / "config.json").read_text())
    arch = ARCH[config["model_type"]]
    writer = gguf.GGUFWriter(str(path), arch)
    _set_parameters(writer, arch, config, gguf.LlamaFileType.GUESSED)
    experts = config.get("num_experts") or config["num_local_experts"]
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    add_tokenizer_metadata(writer, model_dir, kind="gpt2")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    stacks: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    file_values: dict[str, np.ndarray] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for hf in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                values = f.get_tensor(hf).to(torch.float32).numpy()
                match = _EXPERT.fullmatch(hf)
                if match is not None:
                    layer, expert, proj = match.groups()
                    qtype = types[_STACK[proj]]
                    encoded = encode(values, qtype)
                    stacks.setdefault((int(layer), _STACK[proj]), {})[int(expert)] = encoded
                    if keep_values:
                        dense = gguf.quants.dequantize(encoded, qtype)
                        file_values[hf] = dense.reshape(values.shape)
                    continue
                if ".gate.weight" in hf:
                    name = f"blk.{hf.split('.')[2]}.ffn_gate_inp.weight"
                else:
                    name = gguf_name(hf)
                if arch == "llama" and ".attn_q." in name:
                    values = permute(values, heads, heads)
                elif arch == "llama" and ".attn_k." in name:
                    values = permute(values, heads, kv_heads)
                qtype = _dense_type(dense_type, name, values.shape)
                writer.add_tensor(name, encode(values, qtype), raw_dtype=qtype)
    for (layer, proj), by_expert in sorted(stacks.items()):
        data = np.stack([by_expert[e] for e in range(experts)])
        writer.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", data, raw_dtype=types[proj])
        by_expert.clear()
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return file_values


@pytest.fixture(scope="module")
def moe_gguf(model_factory, tmp_path_factory):
    """(arch, expert type) -> (GGUF path, an HF directory holding the file's weights)."""
    made = {}

    def make(arch: str, expert_type: T):
        if (arch, expert_type) not in made:
            source = model_factory(arch)
            root = tmp_path_factory.mktemp(f"{arch}-{expert_type.name}")
            path = root / "model.gguf"
            values = write_moe_gguf(source, path, expert_type)
            reference = root / "hf"
            shutil.copytree(source, reference)
            tensors = load_file(str(source / "model.safetensors"))
            tensors.update((name, v.astype(tensors[name].dtype)) for name, v in values.items())
            save_file(tensors, str(reference / "model.safetensors"), metadata={"format": "pt"})
            made[arch, expert_type] = (path, reference)
        return made[arch, expert_type]

    return make


@pytest.mark.parametrize(
    "arch, expert_type", [("qwen3_moe", T.F32), ("mixtral", T.F32), ("qwen3_moe", T.Q8_0)]
)
def test_gguf_moe_matches_transformers(arch, expert_type, moe_gguf, model_factory, hf_models):
    path, reference = moe_gguf(arch, expert_type)
    llm = LLM(path, dtype="float32")
    cfg = llm.engine.executor.runner.model.cfg
    source = json.loads((model_factory(arch) / "config.json").read_text())
    assert cfg.architecture == source["architectures"][0]
    assert cfg.num_experts == (source.get("num_experts") or source["num_local_experts"])
    assert cfg.dense_layers == tuple(source.get("mlp_only_layers", ()))
    hf = hf_models(reference)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == [hf_greedy(hf, p, 8) for p in PROMPTS]


def test_gguf_moe_bf16_packed_experts(moe_gguf):
    """bf16 on the native kernels: the file's experts packed and run fused, same tokens as the
    safetensors directory of the same weights."""
    path, reference = moe_gguf("qwen3_moe", T.F32)
    from_gguf = LLM(path, dtype="bfloat16").generate(PROMPTS, GREEDY)
    from_hf = LLM(reference, dtype="bfloat16").generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in from_gguf] == [o.outputs[0].token_ids for o in from_hf]


def test_gguf_moe_metadata_and_tp_split_checks(moe_gguf):
    path, _ = moe_gguf("qwen3_moe", T.F32)
    reader = gguf.GGUFReader(str(path))
    names = [t.name for t in reader.tensors]
    assert "blk.0.ffn_down_exps.weight" in names and "blk.1.ffn_down.weight" in names
    from cpud.model.gguf_model import read_gguf_model

    model = read_gguf_model(path)
    assert model.config.dense_layers == (1,) and model.config.num_experts_per_tok == 2
    with pytest.raises(ConfigError, match="--tp"):
        from cpud.model.gguf_model import check_gguf_split

        check_gguf_split(model, 3)
