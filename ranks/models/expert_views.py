"""gpt-oss's Hugging Face expert stacks read as cpud's layout.

gpt-oss stores each layer's experts transposed, with gate and up interleaved along the
intermediate dimension: gate_up_proj [E, H, 2I] (gate = [..., ::2], up = [..., 1::2]),
gate_up_proj_bias [E, 2I] the same way, down_proj [E, I, H]. cpud's experts (ranks/layers/moe.py)
load whole stacks in their own layout: gate_up [E, 2I, H] (gate rows, then up), its bias [E, 2I],
down [E, H, I]. MXFP4 checkpoints (gate_up_proj_blocks [E, 2I, H/32, 16], read as values by
ranks/hf_mxfp4.py) keep the outputs as rows, gate and up rows interleaved: they load as GGUF
expert stacks do (gate, up and down stacks of every expert, in their blocks where the native
kernels run them). A view reads the
experts a loader asks for and returns them rearranged; nothing here imports torch (the
checkpoint's slices come back as tensors)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GATE_UP, DOWN = "gate_up_proj", "down_proj"
ALL = "all"  # ranks/layers/moe.ALL: the shard id's expert for a stack of every expert


def _shape(source: Any) -> list[int]:
    return list(source.get_shape() if hasattr(source, "get_shape") else source.shape)


class StackView:
    """A stacked checkpoint tensor ([E, ...]) as cpud's layout: `deinterleave` (an axis, -1
    or -2, or None) moves that axis's even entries (gate) before its odd ones (up);
    `transposed` swaps the last two axes. Indexed by a range of experts (`view[a:b]`)."""

    def __init__(self, source: Any, deinterleave: int | None, transposed: bool):
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
        if self.deinterleave is not None:
            axis, n = self.deinterleave, piece.shape[self.deinterleave]
            order = list(range(0, n, 2)) + list(range(1, n, 2))
            piece = piece[..., order] if axis == -1 else piece[..., order, :]
        if self.transposed:
            piece = piece.transpose(-1, -2)
        return piece.contiguous()


def _view(deinterleave: int | None, transposed: bool) -> Any:
    return lambda source: StackView(source, deinterleave, transposed)


@dataclass(frozen=True)
class Mxfp4Rows:
    """A window of an MXFP4 `*_blocks` stack's rows, read as GGUF rows by the loader
    (ranks/checkpoint_targets.py through ranks/hf_mxfp4.py, which needs torch)."""

    rows: slice


def _mxfp4_rows(rows: slice) -> Any:
    return Mxfp4Rows(rows)


def _identity(source: Any) -> Any:
    return source


def expert_views(name: str, kind: str, suffix: str) -> list[tuple[str, Any, Any]]:
    """(cpud parameter, shard id, view) of Hugging Face expert tensor `name` (`kind`
    gate_up_proj or down_proj of mlp.experts; `suffix` "" for the weight or "_bias": the whole
    stack, shard None; "_blocks": MXFP4 weights (ranks/hf_mxfp4.py), whose rows are the outputs
    already, as GGUF-like stacks of every expert, shard (ALL, part), dense or kept in blocks)."""
    target = name.removesuffix("_blocks")
    if suffix == "_blocks":  # GGUF-like stacks: gate rows 0::2, up rows 1::2, down whole
        if kind == DOWN:
            return [(target, (ALL, 0), _mxfp4_rows(slice(None)))]
        return [(target, (ALL, p), _mxfp4_rows(slice(p, None, 2))) for p in (0, 1)]
    if kind == DOWN:
        return [(target, None, _identity if suffix else _view(None, True))]
    return [(target, None, _view(-1, not suffix))]


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
