"""The base of every cpud layer: an nn.Module called straight through to forward.

nn.Module.__call__ looks up forward/backward hooks on every call (about 2 us); a decode step
makes ~400 layer calls and cpud registers no hooks, so they go straight to forward."""

from __future__ import annotations

from typing import Any

from torch import nn


class Layer(nn.Module):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)
