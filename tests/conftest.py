"""Shared fixtures: generated models (never downloaded) and a transformers reference."""

from __future__ import annotations

import functools
from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as T
from httpx_tls import shared_default_tls_context

from cpud.fixtures import make_model
from slow_modules import SLOW_MODULES, TESTS

K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.relative_to(TESTS).as_posix() in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def one_tls_context_for_httpx():
    """Top-level httpx calls share one default TLS context (tests/httpx_tls.py)."""
    with shared_default_tls_context():
        yield


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


@pytest.fixture(scope="session")
def gguf_file(model_factory, tmp_path_factory):
    """make(arch, qtype, **write_kw) -> a GGUF of the arch's fixture (its K-quant shape for
    K-quant types) with every matrix in qtype; written once per arguments."""
    import gguf_writer

    root = tmp_path_factory.mktemp("gguf")
    kquant_dirs: dict[str, Path] = {}
    made: dict[tuple, Path] = {}

    def source(arch: str, qtype: T) -> Path:
        if qtype not in K_QUANTS:
            return model_factory(arch)
        if arch not in kquant_dirs:
            kquant_dirs[arch] = gguf_writer.make_kquant_fixture(arch, root / f"{arch}-k-hf")
        return kquant_dirs[arch]

    def make(arch: str, qtype: T = T.F32, **kw) -> Path:
        key = (arch, qtype, tuple(sorted(kw.items())))
        if key not in made:
            folder = root / f"{arch}-{qtype.name}-{len(made)}"
            folder.mkdir()
            made[key] = gguf_writer.write_gguf(
                source(arch, qtype), folder / "model.gguf", qtype, **kw
            )
        return made[key]

    make.source = source
    return make


@pytest.fixture(scope="session")
def hf_gguf():
    """transformers' model for a GGUF file (fp32, eager attention). transformers parses each
    file twice with gguf.GGUFReader and rebuilds gguf's tensor-name map for every module; here
    both read through cpud's faster reader and a cached map (same bytes, same maps). `config`:
    the fixture's own config, where transformers' GGUF metadata mapping lacks a key the fixture
    uses (Qwen3's attention.key_length; llama3 RoPE factors, which it ignores)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from cpud.model.gguf_file import FastReader

    cache: dict[tuple, torch.nn.Module] = {}
    name_map = functools.lru_cache(gguf.get_tensor_name_map)

    def load(path: Path, config_dir: Path | None = None) -> torch.nn.Module:
        key = (str(path), str(config_dir))
        if key not in cache:
            kw = {"config": AutoConfig.from_pretrained(config_dir)} if config_dir else {}
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(gguf, "GGUFReader", FastReader)
                mp.setattr(gguf, "get_tensor_name_map", name_map)
                model = AutoModelForCausalLM.from_pretrained(
                    path.parent,
                    gguf_file=path.name,
                    dtype=torch.float32,
                    attn_implementation="eager",
                    **kw,
                )
            cache[key] = model.eval()
        return cache[key]

    return load
