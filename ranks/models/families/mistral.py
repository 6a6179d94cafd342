"""Mistral: Llama's recipe with a sliding window (4096 when config.json names none, as
transformers' MistralConfig defaults). Its GGUF files say `llama`."""

from __future__ import annotations

from cpud.model.model_config import (
    ConfigFields,
    ModelConfig,
    common_fields,
    decoder_config,
    decoder_fields,
)
from cpud.ranks.models.family import Family


def hf_config(f: ConfigFields, architecture: str) -> ModelConfig:
    common = common_fields(f, architecture, "mistral")
    fields = common | decoder_fields(f, common)
    if "sliding_window" not in f.raw:
        fields["sliding_window"] = 4096
    return decoder_config(fields)


FAMILY = Family(name="mistral", hf_architectures=("MistralForCausalLM",), hf_config=hf_config)
