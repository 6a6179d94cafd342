"""One expert's piece of a Hugging Face gpt-oss expert stack, read as cpud's layout.

gpt-oss stores each layer's experts transposed, with gate and up interleaved along the
intermediate dimension: gate_up_proj [E, H, 2I] (gate = [..., ::2], up = [..., 1::2]),
gate_up_proj_bias [E, 2I] the same way, down_proj [E, I, H], down_proj_bias [E, H]. cpud's experts
load per expert and part: gate or up [I, H], down [H, I], their biases [I] and [H]
(ranks/layers/moe.py). A view reads only the rows and columns a rank asks for; torch-free until
a read returns the checkpoint's tensor."""

from __future__ import annotations

from typing import Any

GATE_UP, DOWN = "gate_up_proj", "down_proj"


class ExpertView:
    """Expert `expert` of a stacked checkpoint tensor `source` ([E, ...]): `part` 0 or 1 of an
    axis that interleaves two (the stack's last), or None; `transposed`: the 2-D piece's axes
    swapped. Indexed by contiguous slices like a checkpoint tensor."""

    def __init__(self, source: Any, expert: int, part: int | None, transposed: bool):
        self.source, self.expert, self.part, self.transposed = source, expert, part, transposed
        shape = list(source.get_shape() if hasattr(source, "get_shape") else source.shape)[1:]
        if part is not None:
            shape[-1] //= 2
        self.shape = shape[::-1] if transposed else shape

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, key: Any) -> Any:
        keys = list(key) if isinstance(key, tuple) else [key]
        keys += [slice(None)] * (len(self.shape) - len(keys))
        bounds = [k.indices(n) for k, n in zip(keys, self.shape)]
        if any(step != 1 for _, _, step in bounds):
            raise TypeError("an expert's piece is read by contiguous ranges")
        if self.transposed:
            bounds = bounds[::-1]
        stored = [slice(start, stop) for start, stop, _ in bounds]
        if self.part is not None:
            start, stop, _ = bounds[-1]
            stored[-1] = slice(2 * start, 2 * stop)
        piece = self.source[(slice(self.expert, self.expert + 1), *stored)][0]
        if self.part is not None:
            piece = piece[..., self.part :: 2]
        if self.transposed:
            piece = piece.transpose(0, 1)
        return piece.contiguous()


def _identity(source: Any) -> Any:
    return source


def expert_views(name: str, kind: str, bias: bool, experts: int) -> list[tuple[str, Any, Any]]:
    """(cpud parameter, shard (expert, part), view) of each piece of checkpoint tensor `name`
    (`kind` gate_up_proj or down_proj of mlp.experts, `bias` its _bias)."""
    target = name  # cpud's parameters keep the checkpoint's names

    def view(expert: int, part: int | None) -> Any:
        return lambda source: ExpertView(source, expert, part, transposed=not bias)

    if kind == GATE_UP:
        return [(target, (e, p), view(e, p)) for e in range(experts) for p in (0, 1)]
    return [(target, (e, 0), view(e, None)) for e in range(experts)]


def renamed(target: str) -> list[tuple[str, Any, Any]]:
    """One piece, read as it is, into parameter `target`."""
    return [(target, None, _identity)]
