"""Shared fixtures: generated models (never downloaded) and a transformers reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cpud.fixtures import make_model

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "opt")


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


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Plain argmax continuation with transformers' own KV cache (no logits processors, so
    EOS is just another token, like ignore_eos=True)."""
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)
    out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    generated: list[int] = []
    for _ in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        generated.append(token)
        mask = torch.cat([mask, torch.ones(1, 1, dtype=torch.long)], dim=1)
        out = model(
            input_ids=torch.tensor([[token]]),
            attention_mask=mask,
            past_key_values=out.past_key_values,
            use_cache=True,
        )
    return generated


@torch.inference_mode()
def hf_logits(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab] logits of one forward pass."""
    return model(input_ids=torch.tensor([prompt])).logits[0].float()
