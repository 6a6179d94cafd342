"""SmolLM3 (ranks/models/families/smollm3.py) on its fixture, four layers of which the last has
no RoPE: the NoPE and window mapping from config.json (a list, the interval, layer_types) and
from GGUF (llama.cpp's fixed interval of 4), family_checks' checks against transformers and of
GGUF files (F16, Q8_0, Q4_K_M) against the same weights, and a sliding-window variant against
transformers."""

from __future__ import annotations

import json
import shutil

import pytest
from family_checks import (
    QTYPES,
    GGUFWeightChecks,
    TransformersChecks,
    check_bf16_logits,
    check_fp32_logits,
    check_greedy,
    check_tp2,
    needs_native,
    prompt_of,
)
from test_parity import engine_logits

from cpud import LLM
from cpud.model.hf_config import parse_model_config
from cpud.model.load import load_model_config
from cpud.model.recipe import LayerRecipe
from cpud.settings.errors import ConfigError
from hf_reference import hf_greedy

ARCH = "smollm3"
NOPE_LAST = (LayerRecipe(), LayerRecipe(), LayerRecipe(), LayerRecipe(rope=-1))


@pytest.fixture(scope="module")
def model_dir(model_factory):
    return model_factory(ARCH)


@pytest.fixture(scope="module")
def raw_config(model_dir):
    return json.loads((model_dir / "config.json").read_text())


def variant(model_dir, out, **changes):
    """The fixture with config.json keys changed (a change to None removes the key)."""
    shutil.copytree(model_dir, out)
    raw = json.loads((out / "config.json").read_text())
    raw.update(changes)
    raw = {k: v for k, v in raw.items() if k not in changes or v is not None}
    (out / "config.json").write_text(json.dumps(raw))
    return out


@pytest.fixture(scope="module")
def sliding_dir(model_dir, tmp_path_factory):
    """NoPE every second layer (from the interval), and those layers on a 6-token window:
    transformers derives layer_types so when use_sliding_window is on."""
    out = tmp_path_factory.mktemp("smollm3") / "sliding"
    return variant(
        model_dir,
        out,
        no_rope_layers=None,
        layer_types=None,
        no_rope_layer_interval=2,
        use_sliding_window=True,
        sliding_window=6,
    )


class TestAgainstTransformers(TransformersChecks):
    """family_checks' checks against transformers, on the fixture as it is."""


def test_config_maps_the_nope_layers(model_dir):
    config = load_model_config(model_dir)
    assert config.recipe.layers == NOPE_LAST
    assert config.tie_word_embeddings and config.sliding_window is None
    assert config.recipe.attention_scale == 16**-0.5
    assert "1 of 4 layers without" in config.recipe.describe()


def test_config_defaults_and_derived_layers(raw_config):
    bare = {k: v for k, v in raw_config.items() if k not in ("no_rope_layers", "layer_types")}
    for key in ("rope_theta", "tie_word_embeddings"):
        bare.pop(key)
    config = parse_model_config(bare)
    assert config.recipe.layers == NOPE_LAST  # every 4th layer by default
    assert config.rope_theta == 2000000.0 and config.tie_word_embeddings
    every_other = parse_model_config(bare | {"no_rope_layer_interval": 2}).recipe.layers
    assert [layer.rope for layer in every_other] == [0, -1, 0, -1]
    window = {"use_sliding_window": True, "sliding_window": 8}
    # Without use_sliding_window's window only the NoPE layers slide; layer_types overrides
    assert parse_model_config(bare | window).recipe.windows == (0, 0, 0, 8)
    types = ["sliding_attention", "full_attention"] * 2
    assert parse_model_config(bare | window | {"layer_types": types}).recipe.windows == (
        8,
        0,
        8,
        0,
    )


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"no_rope_layers": [1, 1, 0]}, "no_rope_layers must be a list of 4 values 0 or 1"),
        ({"no_rope_layers": [1, 2, 1, 0]}, "no_rope_layers must be"),
        ({"no_rope_layers": None, "no_rope_layer_interval": 0}, "no_rope_layer_interval"),
        ({"layer_types": ["full_attention"] * 3 + ["chunked"]}, "layer_types must be"),
        ({"layer_types": ["sliding_attention"] * 4}, "sliding_window is not set"),
        ({"mlp_bias": True}, "feed-forward biases are not supported"),
    ],
    ids=["short", "value", "interval", "type", "no-window", "mlp-bias"],
)
def test_bad_configs_are_refused_by_name(changes, match, raw_config):
    raw = {k: v for k, v in (raw_config | changes).items() if v is not None}
    with pytest.raises(ConfigError, match=match):
        parse_model_config(raw)


def test_the_nope_layer_shows_in_the_logits(model_dir, tmp_path):
    """RoPE on the fixture's NoPE layer changes the logits well beyond the fp32 tolerance, so
    matching transformers means the layer ran without it."""
    roped = variant(model_dir, tmp_path / "roped", no_rope_layers=[1, 1, 1, 1])
    prompt = prompt_of(60, seed=4)
    ours = engine_logits(LLM(model_dir, dtype="float32"), prompt)
    other = engine_logits(LLM(roped, dtype="float32"), prompt)
    assert float((ours - other).abs().max()) > 0.1 * float(ours.std())


def test_sliding_nope_layers_match_transformers(sliding_dir, hf_models):
    assert load_model_config(sliding_dir).recipe.windows == (0, 6, 0, 6)
    check_fp32_logits(sliding_dir, hf_models(sliding_dir))


@needs_native
def test_sliding_nope_layers_bf16_fused(sliding_dir, hf_models):
    check_bf16_logits(sliding_dir, hf_models, "native")


@pytest.mark.slow
def test_sliding_greedy_chunked(sliding_dir, hf_models):
    model = hf_models(sliding_dir)
    prompts = [prompt_of(n, seed=n) for n in TransformersChecks.greedy_lengths]
    expected = [hf_greedy(model, p, TransformersChecks.new_tokens) for p in prompts]
    check_greedy(sliding_dir, prompts, expected, "chunked")


def test_sliding_tp2_logits_equal_tp1(sliding_dir):
    check_tp2(sliding_dir)


class TestGGUFFiles(GGUFWeightChecks):
    arch = ARCH
    # Four layers of int8-rounded activations (test_gguf_quantized's fixtures have two):
    # measured max 0.29 .. 0.53σ, mean 0.040 .. 0.052σ, argmax agreement 0.85 .. 0.93.
    quantized_bounds = (0.7, 0.07, 0.8)

    def test_gguf_config_equals_the_checkpoints(self, gguf_pair, model_dir):
        path, _ = gguf_pair("F16")
        ours, want = load_model_config(path), load_model_config(model_dir)
        assert ours.family == want.family == ARCH
        assert ours.architecture == want.architecture
        assert ours.recipe == want.recipe  # NoPE from llama.cpp's fixed interval of 4
        assert (ours.rope_theta, ours.tie_word_embeddings) == (want.rope_theta, True)

    @pytest.mark.parametrize("qtype", QTYPES)
    def test_gguf_files_keep_the_nope_layer(self, qtype, gguf_pair):
        assert load_model_config(gguf_pair(qtype)[0]).recipe.layers == NOPE_LAST
