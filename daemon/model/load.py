"""A model's config from where it lives (a Hugging Face directory or a GGUF file), and as it
travels to the children (ModelFacts), read from the files once, by the supervisor."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import msgspec

from cpud.model.hf_config import parse_model_config
from cpud.model.model_config import ModelConfig, read_json_object
from cpud.model.pooling_config import sentence_transformers_pooling
from cpud.protocol.launch import ModelFacts
from cpud.settings.errors import ConfigError


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """From a Hugging Face directory's config.json, or from a GGUF file's metadata."""
    if Path(model_dir).is_file():
        from cpud.model.gguf_model import gguf_model_config  # numpy and gguf only for GGUF

        return gguf_model_config(model_dir)
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ConfigError(f"model directory {model_dir} does not exist")
    if not path.is_file():
        raise ConfigError(f"{path} is missing: a model directory needs a Hugging Face config.json")
    config = parse_model_config(read_json_object(path), source=str(path))
    pooling = sentence_transformers_pooling(model_dir)
    if not pooling:
        return config
    config = replace(config, **pooling)
    if config.generates and not config.tie_word_embeddings and _headless(Path(model_dir)):
        # sentence-transformers saved the base model only (Qwen3-Embedding-8B): no LM head,
        # whatever config.json says; the embedding stands in for it
        config = replace(config, tie_word_embeddings=True)
    return config


def _headless(model_dir: Path) -> bool:
    """Whether the checkpoint has no lm_head.weight (safetensors headers only)."""
    from cpud.model.safetensors_check import check_safetensors, weight_files

    return not any("lm_head.weight" in check_safetensors(f) for f in weight_files(model_dir))


def model_facts(model_dir: str | Path, config: ModelConfig) -> ModelFacts:
    """The facts a child needs of the model this process has read: its config, and a GGUF
    file's tensor table."""
    raw = msgspec.Raw(msgspec.json.encode(config))
    if not Path(model_dir).is_file():
        return ModelFacts(raw)
    from cpud.model.gguf_facts import gguf_facts

    return gguf_facts(Path(model_dir), raw)


def config_from_facts(facts: ModelFacts) -> ModelConfig:
    return msgspec.json.decode(facts.config, type=ModelConfig)
