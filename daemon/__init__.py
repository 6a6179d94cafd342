"""cpud: a CPU-native LLM serving daemon.

Names are imported lazily so that light entry points (a rank binding itself before torch
starts, the CLI's --help) do not pay for torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]

_LAZY = {
    "LLM": "cpud.llm",
    "SamplingParams": "cpud.engine.sampling_params",
    "RequestOutput": "cpud.engine.outputs",
    "CompletionOutput": "cpud.engine.outputs",
    "Logprob": "cpud.engine.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'cpud' has no attribute {name!r}")
