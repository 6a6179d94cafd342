"""SmolLM3 (SmolLM3ForCausalLM, GGUF `smollm3`): Llama's layers, some without rotary embedding
(NoPE). config.json lists them in no_rope_layers (1: RoPE, 0: none), else every
no_rope_layer_interval-th layer (default 4) goes without; layer_types (else: the NoPE layers
when use_sliding_window and sliding_window are set) names the sliding-window layers, as
transformers' eager and SDPA attention mask them. llama.cpp hard-codes the interval 4 (no
metadata key) and no window; its converter permutes Q/K rows as for `llama`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cpud.model.model_config import (
    ConfigFields,
    ModelConfig,
    common_fields,
    decoder_config,
    decoder_fields,
    is_int,
)
from cpud.model.recipe import LayerRecipe
from cpud.ranks.models.family import Family
from cpud.settings.errors import ConfigError

if TYPE_CHECKING:
    from cpud.model.gguf_meta import GGUFMeta

ARCHITECTURE = "SmolLM3ForCausalLM"
DEFAULT_THETA = 2000000.0  # SmolLM3Config.default_theta
DEFAULT_KV_HEADS = 4  # SmolLM3Config's num_key_value_heads when config.json lacks the key
GGUF_NO_ROPE_STEP = 4  # llama.cpp's hparams.n_no_rope_layer_step for smollm3
LAYER_TYPES = ("full_attention", "sliding_attention")


def interval_ropes(layers: int, interval: int) -> list[bool]:
    """Whether each layer ropes: all but every `interval`-th."""
    return [(i + 1) % interval != 0 for i in range(layers)]


def _ropes(f: ConfigFields, layers: int) -> list[bool]:
    listed = f.value("no_rope_layers", None)
    if listed is None:
        return interval_ropes(layers, f.size("no_rope_layer_interval", 4))
    if (
        not isinstance(listed, list)
        or len(listed) != layers
        or not all(v in (0, 1) and (is_int(v) or isinstance(v, bool)) for v in listed)
    ):
        raise f.error("no_rope_layers", f"a list of {layers} values 0 or 1 (1: RoPE)", listed)
    return [bool(v) for v in listed]


def _sliding(f: ConfigFields, ropes: list[bool]) -> list[bool]:
    """Whether each layer attends over a sliding window."""
    types = f.value("layer_types", None)
    if types is None:
        on = f.flag("use_sliding_window", False) and f.raw.get("sliding_window") is not None
        return [on and not rope for rope in ropes]
    if (
        not isinstance(types, list)
        or len(types) != len(ropes)
        or not all(t in LAYER_TYPES for t in types)
    ):
        raise f.error("layer_types", f"a list of {len(ropes)} of {', '.join(LAYER_TYPES)}", types)
    return [t == "sliding_attention" for t in types]


def hf_config(f: ConfigFields, architecture: str) -> ModelConfig:
    common = common_fields(f, architecture, "smollm3")
    if "num_key_value_heads" not in f.raw and common["num_heads"] % DEFAULT_KV_HEADS == 0:
        f = ConfigFields(f.raw | {"num_key_value_heads": DEFAULT_KV_HEADS}, f.source, f.arch)
    fields = common | decoder_fields(f, common)
    params = f.raw.get("rope_parameters") or {}
    if f.raw.get("rope_theta") is None and params.get("rope_theta") is None:
        fields["rope_theta"] = DEFAULT_THETA
    fields["tie_word_embeddings"] = f.flag("tie_word_embeddings", True)
    ropes = _ropes(f, common["num_layers"])
    sliding = _sliding(f, ropes)
    window = f.size("sliding_window", 0, minimum=0) if any(sliding) else 0
    if any(sliding) and not window:
        raise ConfigError(
            f"{f.source}: layer_types names sliding_attention layers but sliding_window is "
            f"not set; give sliding_window or make every layer full_attention"
        )
    fields["sliding_window"] = window or None
    layers = tuple(
        LayerRecipe(window=window if slide else 0, rope=0 if rope else -1)
        for rope, slide in zip(ropes, sliding)
    )
    return decoder_config(fields, layers=layers, mlp_bias=f.flag("mlp_bias", False))


def _ffn_biases(tensors: dict[str, Any]) -> bool:
    return any(
        name.startswith("blk.") and ".ffn_" in name and name.endswith(".bias") for name in tensors
    )


def gguf_config(m: GGUFMeta) -> ModelConfig:
    from cpud.model.gguf_meta import decoder_fields as gguf_fields

    fields = gguf_fields(m) | dict(architecture=ARCHITECTURE, family="smollm3")
    ropes = interval_ropes(fields["num_layers"], GGUF_NO_ROPE_STEP)
    layers = tuple(LayerRecipe(rope=0 if rope else -1) for rope in ropes)
    return decoder_config(fields, layers=layers, mlp_bias=_ffn_biases(m.tensors))


FAMILY = Family(
    name="smollm3",
    hf_architectures=(ARCHITECTURE,),
    hf_config=hf_config,
    gguf_architectures=("smollm3",),
    gguf_config=gguf_config,
    gguf_permuted_qk=("smollm3",),
)
