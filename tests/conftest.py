"""Shared fixtures: generated models (never downloaded) and a transformers reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cpud.fixtures import make_model


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """make(arch, **kw) -> Path of a tiny fixture model, generated once per arguments."""
    made: dict[tuple, Path] = {}

    def make(arch: str, preset: str = "tiny", **kwargs) -> Path:
        key = (arch, preset, tuple(sorted(kwargs.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"{arch}-{preset}")
            made[key] = make_model(arch, preset, out, **kwargs)
        return made[key]

    return make


@pytest.fixture(scope="session")
def hf_models():
    """Cache of transformers models by (dir, dtype), loaded eagerly for reference runs."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def load(model_dir: Path, dtype: torch.dtype = torch.float32):
        key = (str(model_dir), dtype)
        if key not in cache:
            model = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=dtype, attn_implementation="eager"
            )
            cache[key] = model.eval()
        return cache[key]

    return load
