"""Tensor-parallel collectives over torch.distributed gloo (the fallback transport).
Tensor collectives only: torch.distributed's object collectives (pickle) are never used."""

from __future__ import annotations

import torch
import torch.distributed as dist


class GlooGroup:
    def __init__(self, rank: int, size: int, init_file: str, timeout_s: float = 60.0):
        from datetime import timedelta

        self.rank = rank
        self.size = size
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=timeout_s),
        )

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor)
        return tensor

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor | None:
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(tensor, parts, dst=0)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
