"""Reference runs through Hugging Face transformers (the implementation cpud must match)."""

from __future__ import annotations

import torch

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "opt")


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
