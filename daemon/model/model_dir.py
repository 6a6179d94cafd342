"""Which model path a --model value names: a leaf module, so that the supervisor and the
frontend resolve it without importing the offline engine (cpud.llm)."""

from __future__ import annotations

import os
from pathlib import Path

from cpud.model.default_model import default_model_path
from cpud.process.user_files import check_regular
from cpud.settings.errors import ConfigError


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    """The given directory, or the GGUF file given or alone in a directory without a
    config.json; the default model (SmolLM2-135M-Instruct GGUF) when none is given."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ConfigError(
                f"model {path} is a file but not a .gguf file: pass a GGUF file or a Hugging "
                f"Face directory"
            )
        return path
    if path.exists() and not path.is_dir():
        check_regular(path, "model ")
    if not path.is_dir():
        raise ConfigError(
            f"model directory {path} does not exist (cpud loads local Hugging Face "
            f"directories and GGUF files; it never downloads)"
        )
    if not (path / "config.json").exists():
        found = sorted(p for p in path.glob("*.gguf") if p.is_file())
        if len(found) == 1:
            return found[0]
        if found:
            names = ", ".join(p.name for p in found[:4]) + (", ..." if len(found) > 4 else "")
            raise ConfigError(
                f"{path} holds {len(found)} GGUF files ({names}): pass the one to load as the model"
            )
    return path
