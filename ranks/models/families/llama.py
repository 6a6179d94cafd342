"""Llama (and Llama-architecture GGUF files): the standard recipe, optional attention bias."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cpud.model.model_config import ConfigFields, ModelConfig, common_fields, decoder_config
from cpud.model.model_config import decoder_fields as hf_decoder_fields
from cpud.ranks.models.family import Family

if TYPE_CHECKING:
    from cpud.model.gguf_meta import GGUFMeta


def hf_config(f: ConfigFields, architecture: str) -> ModelConfig:
    common = common_fields(f, architecture, "llama")
    return decoder_config(common | hf_decoder_fields(f, common))


def gguf_config(m: GGUFMeta) -> ModelConfig:
    from cpud.model.gguf_meta import decoder_fields
    from cpud.ranks.models.families import moe

    if moe.gguf_has_experts(m):  # a `llama` file with experts is Mixtral
        return moe.gguf_config(m)
    fields = decoder_fields(m) | dict(architecture="LlamaForCausalLM", family="llama")
    return decoder_config(fields)


FAMILY = Family(
    name="llama",
    hf_architectures=("LlamaForCausalLM",),
    hf_config=hf_config,
    gguf_architectures=("llama",),
    gguf_config=gguf_config,
    gguf_permuted_qk=("llama",),
)
