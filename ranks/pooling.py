"""Embeddings from a step's final hidden states: each embedding sequence's tokens pooled (its
last token, the mean over its tokens, or its first token: CLS) and L2-normalised where the model
says, as sentence-transformers' Pooling and Normalize modules compute them."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from cpud.protocol.step import Embedding, SeqWork

POOLINGS = ("last", "mean", "cls")


def pool(
    hidden: torch.Tensor, starts: list[int], lens: list[int], pooling: str, normalize: bool
) -> torch.Tensor:
    """[S, H] float32: the rows [starts[i], starts[i] + lens[i]) of `hidden` pooled each."""
    if pooling == "last":
        rows = torch.tensor([s + n - 1 for s, n in zip(starts, lens)], dtype=torch.long)
        pooled = hidden[rows].float()
    elif pooling == "cls":
        pooled = hidden[torch.tensor(starts, dtype=torch.long)].float()
    elif pooling == "mean":
        pooled = torch.stack([hidden[s : s + n].float().mean(0) for s, n in zip(starts, lens)])
    else:
        raise ValueError(f"pooling {pooling!r} is not one of {', '.join(POOLINGS)}")
    return F.normalize(pooled, dim=-1) if normalize else pooled


def embeddings(works: list[SeqWork], pooled: torch.Tensor) -> list[Embedding]:
    """One Embedding per work: its pooled row as float32 little-endian bytes."""
    rows = pooled.detach().to(torch.float32).numpy().astype("<f4", copy=False)
    return [
        Embedding(work.seq_id, np.ascontiguousarray(row).tobytes())
        for work, row in zip(works, rows)
    ]
