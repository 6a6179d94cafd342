"""gpt-oss's Hugging Face expert stacks read as cpud's layout.

gpt-oss stores each layer's experts transposed, with gate and up interleaved along the
intermediate dimension: gate_up_proj [E, H, 2I] (gate = [..., ::2], up = [..., 1::2]),
gate_up_proj_bias [E, 2I] the same way, down_proj [E, I, H]. cpud's experts (ranks/layers/moe.py)
load whole stacks in their own layout: gate_up [E, 2I, H] (gate rows, then up), its bias [E, 2I],
down [E, H, I]. A view reads the experts a loader asks for and returns them rearranged; nothing
here imports torch (the checkpoint's slices come back as tensors)."""

from __future__ import annotations

from typing import Any

GATE_UP, DOWN = "gate_up_proj", "down_proj"
ALL = "all"  # ranks/layers/moe.ALL: the shard id's expert for a stack of every expert


def _shape(source: Any) -> list[int]:
    return list(source.get_shape() if hasattr(source, "get_shape") else source.shape)


class StackView:
    """A stacked checkpoint tensor ([E, ...]) as cpud's layout: `deinterleave` moves the last
    axis's even entries (gate) before its odd ones (up); `transposed` swaps the last two axes.
    Indexed by a range of experts (`view[a:b]`, `view[:]`)."""

    def __init__(self, source: Any, deinterleave: bool, transposed: bool):
        self.source, self.deinterleave, self.transposed = source, deinterleave, transposed
        shape = _shape(source)
        self.shape = [*shape[:-2], shape[-1], shape[-2]] if transposed else shape

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, key: Any) -> Any:
        experts = key[0] if isinstance(key, tuple) else key
        if isinstance(key, tuple) and any(k != slice(None) for k in key[1:]):
            raise TypeError("an expert stack view is read by whole experts")
        start, stop, step = experts.indices(self.shape[0])
        if step != 1:
            raise TypeError("an expert stack view is read by a contiguous range of experts")
        piece = self.source[start:stop]
        if self.deinterleave:
            piece = piece[
                ..., list(range(0, piece.shape[-1], 2)) + list(range(1, piece.shape[-1], 2))
            ]
        if self.transposed:
            piece = piece.transpose(-1, -2)
        return piece.contiguous()


def _view(deinterleave: bool, transposed: bool) -> Any:
    return lambda source: StackView(source, deinterleave, transposed)


def _identity(source: Any) -> Any:
    return source


def expert_views(name: str, kind: str, bias: bool) -> list[tuple[str, Any, Any]]:
    """(cpud parameter, shard id, view) of Hugging Face expert tensor `name` (`kind`
    gate_up_proj or down_proj of mlp.experts, `bias` its _bias): the whole stack, shard None."""
    if kind == DOWN:
        return [(name, None, _identity if bias else _view(False, True))]
    return [(name, None, _view(True, not bias))]


def gguf_bias_views(name: str, proj: str) -> list[tuple[str, Any, Any]]:
    """A GGUF expert stack's bias (blk.N.ffn_{gate,up,down}_exps.bias [E, rows], named
    mlp.experts.{proj}_proj.bias here) as cpud's parameter: the gate and up halves of
    gate_up_proj_bias with shard (ALL, part), down_proj_bias whole."""
    if proj == "down":
        return [(name.replace(".down_proj.bias", ".down_proj_bias"), None, _identity)]
    target = name.replace(f".{proj}_proj.bias", ".gate_up_proj_bias")
    return [(target, (ALL, 0 if proj == "gate" else 1), _identity)]


def renamed(target: str) -> list[tuple[str, Any, Any]]:
    """One piece, read as it is, into parameter `target`."""
    return [(target, None, _identity)]
