"""A model's config from where it lives: a Hugging Face directory or a GGUF file."""

from __future__ import annotations

from pathlib import Path

from cpud.errors import ConfigError
from cpud.model.model_config import ModelConfig, parse_model_config, read_json_object


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
    return parse_model_config(read_json_object(path), source=str(path))
