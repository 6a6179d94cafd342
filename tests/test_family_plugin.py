"""A model family defined only here, registered at test time, loads and generates: a family is
its module (config mapping, tensor names, recipe) and nothing else in cpud changes. Also: every
registered recipe family with a fixture runs the fused native decoder on every ISA tier this
CPU has, never the per-op path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_fused_decoder import blocks_for, both_paths

from cpud import LLM, SamplingParams, native
from cpud.fixtures.archs import ARCH_MODULES
from cpud.model.hf_config import parse_model_config
from cpud.model.model_config import ConfigFields, ModelConfig, decoder_config
from cpud.native.kernels import Kernels
from cpud.protocol.step import SeqWork, StepPlan
from cpud.ranks.fused_decoder import FusedDecoder
from cpud.ranks.models import registry
from cpud.ranks.models.family import Family
from cpud.ranks.ops import NativeOps
from cpud.settings.errors import ConfigError

# The toy checkpoint's own names for the Llama fixture's tensors.
TOY_NAMES = (
    ("attention.wq", "self_attn.q_proj"),
    ("attention.wk", "self_attn.k_proj"),
    ("attention.wv", "self_attn.v_proj"),
    ("attention.wo", "self_attn.o_proj"),
    ("ffn.w1", "mlp.gate_proj"),
    ("ffn.w3", "mlp.up_proj"),
    ("ffn.w2", "mlp.down_proj"),
    ("attention_norm", "input_layernorm"),
    ("ffn_norm", "post_attention_layernorm"),
)


def toy_config(f: ConfigFields, architecture: str) -> ModelConfig:
    """The toy config.json names every field its own way."""
    fields = dict(
        architecture=architecture,
        family="toy",
        model_type="toy",
        hidden_size=f.size("dim"),
        num_layers=f.size("n_layers"),
        num_heads=f.size("n_heads"),
        num_kv_heads=f.size("n_kv_heads"),
        head_dim=f.size("dim") // f.size("n_heads"),
        intermediate_size=f.size("ffn_dim"),
        vocab_size=f.size("vocab"),
        max_position_embeddings=f.size("context"),
        norm_eps=f.number("eps", 1e-5),
        tie_word_embeddings=f.flag("tied", True),
        checkpoint_dtype=f.text("dtype", None),
        rope_theta=f.number("rope_base", 10000.0),
        rope_scaling=f.value("rope_scaling", None),
        bos_token_id=f.token_id("bos"),
        eos_token_ids=f.token_ids("eos"),
    )
    return decoder_config(fields)


TOY = Family(
    name="toy",
    hf_architectures=("ToyForCausalLM",),
    hf_config=toy_config,
    checkpoint_renames=tuple((toy, ours) for toy, ours in TOY_NAMES),
)


def toy_checkpoint(llama_dir: Path, out: Path) -> Path:
    """The Llama fixture's weights and tokenizer as a toy checkpoint: its own config keys and
    tensor names."""
    out.mkdir(exist_ok=True)
    for path in llama_dir.iterdir():
        if path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy(path, out / path.name)
    raw = json.loads((llama_dir / "config.json").read_text())
    toy = {
        "architectures": ["ToyForCausalLM"],
        "dim": raw["hidden_size"],
        "n_layers": raw["num_hidden_layers"],
        "n_heads": raw["num_attention_heads"],
        "n_kv_heads": raw["num_key_value_heads"],
        "ffn_dim": raw["intermediate_size"],
        "vocab": raw["vocab_size"],
        "context": raw["max_position_embeddings"],
        "eps": raw["rms_norm_eps"],
        "tied": raw["tie_word_embeddings"],
        "rope_base": raw["rope_theta"],
        "rope_scaling": raw["rope_scaling"],
        "bos": raw["bos_token_id"],
        "eos": raw["eos_token_id"],
    }
    (out / "config.json").write_text(json.dumps(toy))
    tensors = load_file(str(llama_dir / "model.safetensors"))
    renamed = {}
    for name, value in tensors.items():
        for toy_name, ours in TOY_NAMES:
            name = name.replace(f".{ours}.", f".{toy_name}.")
        renamed[name] = value
    save_file(renamed, str(out / "model.safetensors"))
    return out


def greedy(llm: LLM, prompt: str) -> list[int]:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    return llm.generate([prompt], params)[0].outputs[0].token_ids


def test_unregistered_family_is_refused_by_name(model_factory, tmp_path):
    toy_dir = toy_checkpoint(model_factory("llama"), tmp_path / "toy")
    raw = json.loads((toy_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match="'ToyForCausalLM'.*not supported"):
        parse_model_config(raw)


@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_a_family_defined_in_a_test_loads_and_generates(kernels, model_factory, tmp_path):
    if kernels == "native" and not native.available():
        pytest.skip("native library not built")
    llama_dir = model_factory("llama")
    toy_dir = toy_checkpoint(llama_dir, tmp_path / "toy")
    prompt = "The weather today is"
    reference = LLM(model=llama_dir, dtype="bfloat16", kernels=kernels)
    expected = greedy(reference, prompt)
    reference.shutdown()
    with registry.registered(TOY):
        toy = LLM(model=toy_dir, dtype="bfloat16", kernels=kernels)
        assert toy.engine.config.model.family == "toy"
        assert greedy(toy, prompt) == expected
        toy.shutdown()
    assert registry.for_hf(["ToyForCausalLM"]) is None  # gone after the block


def test_registering_a_taken_name_is_refused():
    with pytest.raises(ValueError, match="registered already"):
        with registry.registered(Family("llama", ("X",), toy_config)):
            pass


RECIPE_FIXTURES = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"]
RECIPE_FIXTURES += [  # the plug-in fixtures of decoder families (encoders have no recipe)
    arch
    for arch, module in ARCH_MODULES.items()
    if registry.for_hf([module.HF_CLASS]).model in ("decoder", "moe")
]


@pytest.mark.skipif(not native.available(), reason="native library not built")
@pytest.mark.parametrize("arch", RECIPE_FIXTURES)
def test_every_recipe_family_runs_fused_on_every_tier(arch, model_factory):
    """bf16 on the native kernels: the fused decoder is chosen, and on every tier this CPU runs
    it gives the per-op path's logits (same kernels: the same bits on the default tier)."""
    llm = LLM(model=model_factory(arch), dtype="bfloat16", kernels="native")
    runner = llm.engine.executor.runner
    family = llm.engine.config.model.family
    assert registry.by_name(family).model in ("decoder", "moe")
    assert runner.decoder is not None, f"{arch} ({family}) fell back to the per-op path"
    default = runner.decoder
    prompt = [(37 * i + 11) % 200 + 3 for i in range(40)]
    plan = StepPlan(0, [SeqWork(0, prompt, 0, blocks_for(len(prompt), 0), False)])
    fused, per_op = both_paths(runner, plan)
    assert torch.equal(fused, per_op)
    for isa in native.supported_isas():
        runner.decoder = FusedDecoder(
            runner.model, NativeOps(Kernels(isa)), runner.group, runner.kv_caches
        )
        logits = runner.prompt_logits(plan)
        assert torch.isfinite(logits).all(), isa
        close = (logits - per_op).abs().max() / per_op.abs().max()
        assert close < 0.05, f"{arch} on {isa}: {close:.3f} of the logits' range off"
        assert (logits.argmax(-1) == per_op.argmax(-1)).float().mean() > 0.9, isa
    runner.decoder = default
