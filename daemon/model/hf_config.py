"""A Hugging Face config.json as cpud's ModelConfig: the registered family of its
architecture reads it (ranks/models/registry.py)."""

from __future__ import annotations

from typing import Any

from cpud.model.model_config import ConfigFields, ModelConfig
from cpud.model.recipe import check_recipe
from cpud.ranks.models import registry
from cpud.settings.errors import ConfigError, one_line


def parse_model_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """The decoder's settings from a decoded config.json; a ConfigError names the key at fault
    (wrong type, not positive, not finite, or inconsistent with another key)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source} holds a JSON {type(raw).__name__}, not an object")
    archs = raw.get("architectures") or []
    if not isinstance(archs, list):
        raise ConfigError(
            f"{source}: architectures must be a list, got {one_line(repr(archs), 60)}"
        )
    match = registry.hf_match(archs)
    if match is None:
        names = registry.supported_hf()
        suffix = "ForCausalLM"
        causal = [n.removesuffix(suffix) for n in names if n.endswith(suffix)]
        others = [n for n in names if not n.endswith(suffix)]
        shown = ", ".join(causal) + f" (each ...{suffix})" if causal else ""
        shown = "; ".join(part for part in (shown, ", ".join(others)) if part)
        raise ConfigError(
            f"{source}: architecture {archs or raw.get('model_type')!r} is not supported "
            f"(supported: {shown})"
        )
    family, arch = match
    config = family.hf_config(ConfigFields(raw, source, arch), arch)
    if config.recipe is not None:
        check_recipe(config.recipe, config.head_dim, source)
    return config
