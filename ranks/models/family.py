"""What a model family module declares (ranks/models/families/): the architecture names it
answers to, its config and tensor-name mappings, and (through its configs) its decoder recipe.
Torch-free."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cpud.model.gguf_meta import GGUFMeta
    from cpud.model.model_config import ConfigFields, ModelConfig

# The torch modules that build a family's model (ranks/models/build.py)
MODEL_KINDS = ("decoder", "moe", "opt", "encoder")  # encoder: embeddings only, no KV cache


@dataclass(frozen=True)
class Family:
    name: str
    hf_architectures: tuple[str, ...]
    # config.json (read through ConfigFields) -> ModelConfig with its recipe
    hf_config: Callable[[ConfigFields, str], ModelConfig]
    gguf_architectures: tuple[str, ...] = ()
    # GGUF metadata and tensor table -> ModelConfig with its recipe
    gguf_config: Callable[[GGUFMeta], ModelConfig] | None = None
    model: str = "decoder"
    # (checkpoint name fragment, cpud module name fragment); the first that matches applies
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    # A checkpoint tensor holding several of cpud's parts stacked by rows: (checkpoint
    # fragment, cpud fragment, part ids in row order); sizes come from the model.
    fused_checkpoint: tuple[tuple[str, str, tuple[Any, ...]], ...] = ()
    # (cpud's name of a checkpoint tensor, config) -> [(parameter, shard id, view)] where
    # view(source) reads the tensor's piece in cpud's layout (gpt-oss's interleaved expert
    # stacks), or None: the tensor loads as it is.
    checkpoint_views: (
        Callable[[str, ModelConfig], list[tuple[str, Any, Callable]] | None] | None
    ) = None
    # GGUF layer tensor stems -> cpud module names, over the common table (model/gguf_names.py)
    gguf_layer_names: Mapping[str, str] = field(default_factory=dict)
    # GGUF top-level tensor stems -> cpud module names, over the common table
    gguf_top_names: Mapping[str, str] = field(default_factory=dict)
    # llama.cpp's converter interleaves Q/K rows of these GGUF architectures for its RoPE
    gguf_permuted_qk: tuple[str, ...] = ()
    # GGUF tensors of a config (name -> Expected) when they differ from the common table
    gguf_tensors: Callable[[ModelConfig], dict[str, Any]] | None = None
    # Chat template for files that carry none
    chat_template: str | None = None
    # (checkpoint tensor, K per rank) of each kind of linear when not the Llama names
    linear_ks: Callable[[ModelConfig, int], list[tuple[str, int]]] | None = None
    linears_per_layer: int = 7  # q, k, v, o, gate, up, down

    def __post_init__(self) -> None:
        if self.model not in MODEL_KINDS:
            raise ValueError(f"family {self.name}: model {self.model!r} not in {MODEL_KINDS}")
