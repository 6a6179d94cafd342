"""Granite 3.x (ranks/models/families/granite.py) on its fixture, whose four multipliers are far
from 1: the config mapping from config.json and from GGUF metadata, family_checks' checks
against transformers and of GGUF files (F16, Q8_0, Q4_K_M) against the same weights, an
attention-bias checkpoint, and the clear refusals (MLP biases, GraniteMoe)."""

from __future__ import annotations

import json
import math
import shutil
from unittest import mock

import gguf
import gguf_writer
import pytest
import torch
from family_checks import GGUFWeightChecks, TransformersChecks, check_fp32_logits
from gguf import GGMLQuantizationType as T

from cpud.fixtures.archs import granite as fixture
from cpud.model.gguf_model import read_gguf_model
from cpud.model.hf_config import parse_model_config
from cpud.model.load import load_model_config
from cpud.settings.errors import ConfigError

ARCH = "granite"


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(ARCH)


class TestAgainstTransformers(TransformersChecks):
    """family_checks' checks against transformers, on the fixture as it is."""


def test_config_maps_the_multipliers(model_dir):
    recipe = load_model_config(model_dir).recipe
    assert recipe.embedding_multiplier == fixture.EMBEDDING_MULTIPLIER
    assert recipe.residual_multiplier == fixture.RESIDUAL_MULTIPLIER
    assert recipe.attention_scale == fixture.ATTENTION_MULTIPLIER != 16**-0.5
    assert recipe.logit_multiplier == 1 / fixture.LOGITS_SCALING
    assert not recipe.embedding_multiplier_in_dtype  # a bf16 tensor times a Python float
    assert all(layer.rope == 0 and layer.window == 0 for layer in recipe.layers)
    assert "embedding x12, residual x0.22, logits x0.125" in recipe.describe()


def test_multipliers_default_to_granite_config(model_dir):
    raw = json.loads((model_dir / "config.json").read_text())
    for key in ("attention_multiplier", "embedding_multiplier", "residual_multiplier"):
        raw.pop(key)
    raw.pop("logits_scaling")
    recipe = parse_model_config(raw).recipe
    # GraniteConfig's defaults are 1.0, the attention multiplier included (not 1/sqrt(d))
    assert recipe.attention_scale == 1.0
    assert recipe.embedding_multiplier == recipe.residual_multiplier == 1.0
    assert recipe.logit_multiplier == 1.0


def test_mlp_bias_is_refused_by_name(model_dir):
    raw = json.loads((model_dir / "config.json").read_text()) | {"mlp_bias": True}
    with pytest.raises(ConfigError, match="feed-forward biases are not supported"):
        parse_model_config(raw)


def test_granite_moe_is_not_registered(model_dir, tmp_path):
    raw = json.loads((model_dir / "config.json").read_text())
    raw |= {"architectures": ["GraniteMoeForCausalLM"], "model_type": "granitemoe"}
    with pytest.raises(ConfigError, match="'GraniteMoeForCausalLM'.*not supported"):
        parse_model_config(raw)
    with mock.patch.dict(gguf_writer.GGUF_ARCH, {ARCH: "granitemoe"}):
        path = gguf_writer.write_gguf(model_dir, tmp_path / "moe.gguf", T.F16)
    with pytest.raises(ConfigError, match="'granitemoe' is not supported"):
        read_gguf_model(path)


def test_attention_bias_checkpoint(model_dir, hf_models, tmp_path):
    """attention_bias puts biases on q, k, v and o, as transformers' GraniteAttention does."""
    from safetensors.torch import load_file, save_file

    biased = tmp_path / "granite-bias"
    shutil.copytree(model_dir, biased)
    raw = json.loads((biased / "config.json").read_text()) | {"attention_bias": True}
    (biased / "config.json").write_text(json.dumps(raw))
    tensors = load_file(biased / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name in list(tensors):
        if any(name.endswith(f"self_attn.{p}.weight") for p in ("q_proj", "k_proj", "v_proj")):
            rows = tensors[name].shape[0]
            tensors[name.replace(".weight", ".bias")] = 0.3 * torch.randn(rows, generator=generator)
        elif name.endswith("self_attn.o_proj.weight"):
            rows = tensors[name].shape[0]
            tensors[name.replace(".weight", ".bias")] = 3 * torch.randn(rows, generator=generator)
    save_file(tensors, biased / "model.safetensors", metadata={"format": "pt"})
    check_fp32_logits(biased, hf_models(biased))


def _rewritten(path, tmp_path, drop: tuple[str, ...] = (), add: dict | None = None):
    """The GGUF file with metadata keys dropped or added (tensors as they were)."""
    reader = gguf.GGUFReader(path)
    tmp_path.mkdir()
    out = tmp_path / "rewritten.gguf"
    writer = gguf.GGUFWriter(str(out), ARCH)
    for field in reader.fields.values():
        name = field.name
        if name in drop or name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, vtype, sub_type=sub)
    for name, value in (add or {}).items():
        writer.add_key_value(name, value[0], value[1])
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


class TestGGUFFiles(GGUFWeightChecks):
    arch = ARCH

    def test_gguf_config_equals_the_checkpoints(self, gguf_pair, model_dir):
        path, _ = gguf_pair("F16")
        ours, want = load_model_config(path), load_model_config(model_dir)
        assert ours.family == want.family == ARCH
        assert ours.architecture == want.architecture
        # GGUF keeps the multipliers as float32
        for name in ("attention_scale", "embedding_multiplier", "residual_multiplier"):
            want_value = getattr(want.recipe, name)
            assert getattr(ours.recipe, name) == pytest.approx(want_value, rel=1e-7)
        assert ours.recipe.logit_multiplier == want.recipe.logit_multiplier
        assert ours.recipe.layers == want.recipe.layers
        assert (ours.head_dim, ours.num_kv_heads, ours.tie_word_embeddings) == (16, 2, True)

    def test_gguf_scales_as_llama_cpp_reads_them(self, gguf_pair, tmp_path):
        """Absent (or zero) attention, embedding and residual scales mean 1/sqrt(head_dim), 1
        and 1; an absent logit scale is refused (llama.cpp requires it);
        rope.scaling.finetuned false turns RoPE off on every layer."""
        path, _ = gguf_pair("F16")
        keys = ("granite.attention.scale", "granite.embedding_scale", "granite.residual_scale")
        bare = load_model_config(_rewritten(path, tmp_path / "a", drop=keys)).recipe
        assert bare.attention_scale == pytest.approx(1 / math.sqrt(16))
        assert bare.embedding_multiplier == bare.residual_multiplier == 1.0
        f32 = gguf.GGUFValueType.FLOAT32
        zero = _rewritten(path, tmp_path / "z", drop=keys, add={k: (0.0, f32) for k in keys})
        assert load_model_config(zero).recipe == bare
        with pytest.raises(ConfigError, match="lacks granite.logit_scale"):
            load_model_config(_rewritten(path, tmp_path / "b", drop=("granite.logit_scale",)))
        add = {"granite.rope.scaling.finetuned": (False, gguf.GGUFValueType.BOOL)}
        nope = load_model_config(_rewritten(path, tmp_path / "c", add=add)).recipe
        assert all(layer.rope == -1 for layer in nope.layers)
