"""The tensor-parallel group a rank belongs to: its index, the group size, the collectives."""

from __future__ import annotations

from typing import Protocol

import torch


class TPGroup(Protocol):
    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over all ranks, in place; returns it."""
        ...

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's `tensor` along the last dim on rank 0 (None elsewhere)."""
        ...


class SingleRank:
    """tp=1: collectives are identities."""

    rank = 0
    size = 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor | None:
        return tensor
