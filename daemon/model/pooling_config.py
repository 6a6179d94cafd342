"""How a model's embeddings are pooled, as its files declare it: a sentence-transformers
directory (modules.json: a Pooling module's config.json, a Normalize module) or a GGUF file's
`{arch}.pooling_type`. Torch-free."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cpud.model.model_config import read_json_object
from cpud.settings.errors import ConfigError, one_line


def short(value: Any) -> str:
    return one_line(repr(value), 60)


POOLINGS = ("last", "mean", "cls")
# sentence-transformers' mode names (Pooling's pooling_mode, or its legacy boolean keys)
_ST_MODES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
_ST_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# llama.cpp's enum llama_pooling_type (gguf.PoolingType): 0 none, 4 rank (rerankers)
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}
# Modules that leave the pooled vector as it is (or come before pooling)
_PASSIVE = ("Transformer", "Dropout")


def _modules(path: Path) -> list[dict[str, Any]]:
    try:
        modules = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ConfigError(f"{path} is not a readable JSON file: {one_line(str(exc), 80)}") from None
    if not isinstance(modules, list) or not all(
        isinstance(m, dict) and isinstance(m.get("type"), str) for m in modules
    ):
        raise ConfigError(f"{path} must be a list of modules, each with a type")
    return modules


def _st_mode(config: dict[str, Any], source: Path) -> str:
    """The one pooling mode of a Pooling module's config.json, in sentence-transformers' names."""
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [name for key, name in _ST_FLAGS.items() if config.get(key) is True]
        mode = modes or ["mean"]  # sentence-transformers' default
    modes = mode if isinstance(mode, list) else [mode]
    if len(modes) != 1:
        raise ConfigError(
            f"{source}: pooling modes {one_line(repr(modes), 80)} are concatenated, which cpud "
            f"does not do: it pools with one of {', '.join(_ST_MODES)}"
        )
    if modes[0] not in _ST_MODES:
        raise ConfigError(
            f"{source}: pooling mode {one_line(repr(modes[0]), 40)} is not supported "
            f"(supported: {', '.join(_ST_MODES)})"
        )
    return modes[0]


def sentence_transformers_pooling(model_dir: str | Path) -> dict[str, Any]:
    """ModelConfig's pooling and normalize fields from a directory's sentence-transformers
    files; {} when it has no modules.json. A module after the Transformer that cpud does not
    run (Dense, LayerNorm, ...) is a ConfigError: its embeddings would come out wrong."""
    root = Path(model_dir)
    path = root / "modules.json"
    if not path.is_file():
        return {}
    pooling, normalize = None, False
    for module in _modules(path):
        kind = module["type"].rsplit(".", 1)[-1]
        if kind == "Pooling":
            folder = module.get("path")
            if not isinstance(folder, str):
                raise ConfigError(f"{path}: the Pooling module has no path")
            config_path = root / folder / "config.json"
            mode = _st_mode(read_json_object(config_path), config_path)
            pooling = _ST_MODES[mode]
        elif kind == "Normalize":
            normalize = True
        elif kind not in _PASSIVE:
            raise ConfigError(
                f"{path}: module {one_line(repr(module['type']), 80)} is not supported: cpud "
                f"pools and normalises embeddings, it does not run further modules"
            )
    return {"pooling": pooling, "normalize": normalize}


def gguf_pooling(value: Any, source: str, key: str) -> dict[str, Any]:
    """ModelConfig's pooling fields from a GGUF pooling_type value (None: the key is absent).
    llama.cpp's server normalises embeddings by default, so a file that declares a pooling is
    normalised."""
    if value is None or value == 0:
        return {}
    if isinstance(value, bool) or not isinstance(value, int) or value not in _GGUF_POOLING:
        wanted = "0 (none), 1 (mean), 2 (cls) or 3 (last)"
        if value == 4:
            wanted += ": rank pooling (rerankers) is not supported"
        raise ConfigError(f"{source}: GGUF metadata {key} must be {wanted}, got {short(value)}")
    return {"pooling": _GGUF_POOLING[value], "normalize": True}
