"""Qwen2 (qkv bias) and Qwen3 (per-head q/k norm): the standard recipe; sliding window only
with use_sliding_window."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cpud.model.model_config import (
    ConfigFields,
    ModelConfig,
    common_fields,
    decoder_config,
    decoder_fields,
)
from cpud.ranks.models.family import Family

if TYPE_CHECKING:
    from cpud.model.gguf_meta import GGUFMeta

GGUF_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def qwen_window(f: ConfigFields, fields: dict) -> None:
    if not f.flag("use_sliding_window", False):
        fields["sliding_window"] = None


def hf_config(f: ConfigFields, architecture: str) -> ModelConfig:
    common = common_fields(f, architecture, "qwen")
    fields = common | decoder_fields(f, common)
    qwen_window(f, fields)
    if architecture == "Qwen2ForCausalLM":
        fields["qkv_bias"] = True
    else:
        fields["qk_norm"] = True
    return decoder_config(fields)


def gguf_config(m: GGUFMeta) -> ModelConfig:
    from cpud.model.gguf_meta import decoder_fields as gguf_fields

    fields = gguf_fields(m) | dict(architecture=GGUF_ARCHITECTURES[m.arch], family="qwen")
    if m.arch == "qwen2":
        fields["qkv_bias"] = True
    else:
        fields["qk_norm"] = True
    return decoder_config(fields)


FAMILY = Family(
    name="qwen",
    hf_architectures=tuple(GGUF_ARCHITECTURES.values()),
    hf_config=hf_config,
    gguf_architectures=tuple(GGUF_ARCHITECTURES),
    gguf_config=gguf_config,
)
