"""A decoder recipe: what a model family's decoder layers compute, as data. The family module
(ranks/models/families/) builds it from the checkpoint's config; the per-op decoder
(ranks/models/decoder.py) and the fused native decoder (native/drivers/decoder.c) both execute it. A
family whose layers this cannot express is refused at load (`check_recipe`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from cpud.settings.errors import ConfigError

NORMS = ("rms", "rms_fp32_weight")
ACTIVATIONS = ("silu", "gelu_tanh")
ROTARY_STYLES = ("neox", "gptj")


@dataclass(frozen=True)
class Rope:
    """One RoPE table: base and scaling (a rope_scaling dict as ModelConfig holds it)."""

    theta: float
    scaling: dict[str, Any] | None = field(default=None, hash=False)


@dataclass(frozen=True)
class LayerRecipe:
    window: int = 0  # sliding-window attention over this many tokens (self included); 0: global
    rope: int = 0  # index into DecoderRecipe.ropes; -1: no rotary embedding (NoPE)


@dataclass(frozen=True)
class DecoderRecipe:
    layers: tuple[LayerRecipe, ...]
    ropes: tuple[Rope, ...]
    attention_scale: float
    # "rms": weight * dt(normalized) (Llama); "rms_fp32_weight": dt(normalized * weight) with
    # fp32 weights (Gemma's "1 + weight" form: the offset is added to the weights at load).
    norm: str = "rms"
    norm_weight_offset: float = 0.0
    # A norm on the attention output and on the feed-forward output before each residual add
    # (Gemma 2/3: post_attention_layernorm and post_feedforward_layernorm).
    sandwich_norms: bool = False
    activation: str = "silu"  # gated: act(gate) * up
    qk_norm: bool = False
    rotary: str = "neox"
    rotary_dim: int = 0  # dims of each head that rotate (partial rotary below head_dim)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    embedding_multiplier: float = 1.0
    # Gemma multiplies by the multiplier rounded to the model dtype first; Granite does not.
    embedding_multiplier_in_dtype: bool = False
    residual_multiplier: float = 1.0  # each block's output, before its residual add (Granite)
    logit_multiplier: float = 1.0  # Granite: 1 / logits_scaling
    final_logit_softcap: float = 0.0  # logits = cap * tanh(logits / cap); 0: none
    attention_softcap: float = 0.0
    # A learned logit per head joined to each softmax's denominator, with no value (gpt-oss):
    # each layer's attention holds `sinks` [heads].
    attention_sinks: bool = False

    @property
    def windows(self) -> tuple[int, ...]:
        return tuple(layer.window for layer in self.layers)

    def describe(self) -> str:
        """One line for the startup log and `cpud doctor`."""
        parts = [f"{self.norm} norm"]
        if self.norm_weight_offset:
            parts[-1] += f" ({self.norm_weight_offset:g} + weight)"
        if self.sandwich_norms:
            parts.append("sandwich norms")
        parts.append(f"gated {self.activation}")
        if self.qk_norm:
            parts.append("q/k norm")
        nope = sum(layer.rope < 0 for layer in self.layers)
        rot = f"{self.rotary} rotary dim {self.rotary_dim}"
        bases = sorted({f"{r.theta:g}" for r in self.ropes})
        rot += f" base {'/'.join(bases)}"
        kinds = sorted({(r.scaling or {}).get("rope_type", "default") for r in self.ropes})
        if kinds != ["default"]:
            rot += f" ({'/'.join(kinds)} scaling)"
        if nope:
            rot += f", {nope} of {len(self.layers)} layers without"
        parts.append(rot)
        sliding = [w for w in self.windows if w]
        if sliding:
            parts.append(
                f"sliding window {max(sliding)} on {len(sliding)}/{len(self.layers)} layers"
            )
        parts.append(f"attention scale {self.attention_scale:.4g}")
        if self.attention_sinks:
            parts.append("attention sinks")
        biases = [n for n, on in (("qkv", self.qkv_bias), ("o", self.o_bias)) if on]
        if biases:
            parts.append(f"{'+'.join(biases)} bias")
        for name, value in (
            ("embedding x", self.embedding_multiplier),
            ("residual x", self.residual_multiplier),
            ("logits x", self.logit_multiplier),
        ):
            if value != 1.0:
                parts.append(f"{name}{value:.4g}")
        if self.final_logit_softcap:
            parts.append(f"logit soft-cap {self.final_logit_softcap:g}")
        return ", ".join(parts)


def _positive(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def check_recipe(recipe: DecoderRecipe, head_dim: int, source: str) -> None:
    """ConfigError when cpud's decoders cannot run `recipe` (a family module asked for more than
    they execute), naming what to change."""

    def refuse(what: str) -> ConfigError:
        return ConfigError(f"{source}: {what}; cpud's decoder cannot run this model")

    if recipe.norm not in NORMS:
        raise refuse(f"norm kind {recipe.norm!r} is not one of {', '.join(NORMS)}")
    if recipe.activation not in ACTIVATIONS:
        raise refuse(f"activation {recipe.activation!r} is not one of {', '.join(ACTIVATIONS)}")
    if recipe.rotary not in ROTARY_STYLES:
        raise refuse(f"rotary style {recipe.rotary!r} is not one of {', '.join(ROTARY_STYLES)}")
    if recipe.mlp_bias:
        raise refuse("feed-forward biases are not supported")
    if recipe.attention_softcap:
        raise refuse("attention logit soft-capping is not supported")
    if not recipe.layers or not recipe.ropes:
        raise refuse("the recipe has no layers or no RoPE table")
    if any(layer.window < 0 or layer.rope >= len(recipe.ropes) for layer in recipe.layers):
        raise refuse("a layer names a window below 0 or a RoPE table that does not exist")
    if recipe.rotary_dim < 2 or recipe.rotary_dim % 2 or recipe.rotary_dim > head_dim:
        raise refuse(f"rotary dimension {recipe.rotary_dim} is not even and within {head_dim}")
    for name in (
        "attention_scale",
        "embedding_multiplier",
        "residual_multiplier",
        "logit_multiplier",
    ):
        if not _positive(getattr(recipe, name)):
            raise refuse(f"{name} {getattr(recipe, name)!r} is not a positive number")
    if recipe.final_logit_softcap < 0 or not math.isfinite(recipe.final_logit_softcap):
        raise refuse(f"final_logit_softcap {recipe.final_logit_softcap!r} is not >= 0")
