"""IBM Granite 3.x (GraniteForCausalLM, GGUF `granite`): Llama's layers with four multipliers,
as transformers' modeling_granite applies them: the input embeddings times
embedding_multiplier, each attention and feed-forward output times residual_multiplier before
its residual add, attention_multiplier as the attention scale (in place of 1/sqrt(head_dim)),
and the logits divided by logits_scaling. llama.cpp's converter writes them as
granite.embedding_scale, granite.residual_scale, granite.attention.scale and
granite.logit_scale, and permutes Q/K rows as for `llama`. GraniteMoe is not registered."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cpud.model.model_config import (
    ConfigFields,
    ModelConfig,
    common_fields,
    decoder_config,
    decoder_fields,
)
from cpud.model.recipe import LayerRecipe
from cpud.ranks.models.family import Family

if TYPE_CHECKING:
    from cpud.model.gguf_meta import GGUFMeta

ARCHITECTURE = "GraniteForCausalLM"


def hf_config(f: ConfigFields, architecture: str) -> ModelConfig:
    common = common_fields(f, architecture, "granite")
    fields = common | decoder_fields(f, common)
    fields["sliding_window"] = None  # transformers' Granite attends globally on every layer
    return decoder_config(
        fields,
        # GraniteConfig's defaults: 1.0 each, the attention scale included
        attention_scale=f.number("attention_multiplier", 1.0),
        embedding_multiplier=f.number("embedding_multiplier", 1.0),
        residual_multiplier=f.number("residual_multiplier", 1.0),
        logit_multiplier=1.0 / f.number("logits_scaling", 1.0),
        mlp_bias=f.flag("mlp_bias", False),  # refused by check_recipe, naming it
    )


def _scale(m: GGUFMeta, key: str) -> float | None:
    """A multiplier llama.cpp applies only when set and non-zero; None otherwise."""
    value = m.get(key)
    if value is None or (isinstance(value, (int, float)) and value == 0):
        return None
    return m.number(key)


def _ffn_biases(tensors: dict[str, Any]) -> bool:
    return any(
        name.startswith("blk.") and ".ffn_" in name and name.endswith(".bias") for name in tensors
    )


def gguf_config(m: GGUFMeta) -> ModelConfig:
    from cpud.model.gguf_meta import decoder_fields as gguf_fields

    fields = gguf_fields(m) | dict(architecture=ARCHITECTURE, family="granite")
    changes: dict[str, Any] = dict(
        logit_multiplier=1.0 / m.number("logit_scale"),  # llama.cpp requires it
        embedding_multiplier=_scale(m, "embedding_scale") or 1.0,
        residual_multiplier=_scale(m, "residual_scale") or 1.0,
        attention_scale=_scale(m, "attention.scale") or fields["head_dim"] ** -0.5,
        mlp_bias=_ffn_biases(m.tensors),
    )
    # llama.cpp's Granite graph ropes only while rope.scaling.finetuned (default true) holds
    if m.get("rope.scaling.finetuned", True) is False:
        changes["layers"] = tuple(LayerRecipe(rope=-1) for _ in range(fields["num_layers"]))
    return decoder_config(fields, **changes)


FAMILY = Family(
    name="granite",
    hf_architectures=(ARCHITECTURE,),
    hf_config=hf_config,
    gguf_architectures=("granite",),
    gguf_config=gguf_config,
    gguf_permuted_qk=("granite",),
)
