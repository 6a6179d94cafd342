"""Which linears of a model stay quantized, and how that is reported (startup log, doctor)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from torch import nn

from cpud.ranks.gguf_model import read_gguf_model
from cpud.ranks.gguf_names import hf_name
from cpud.ranks.layers.embedding import ParallelLMHead
from cpud.ranks.layers.linear import PackableLinear
from cpud.ranks.loader import stacked_target
from cpud.ranks.quant_linear import FLOAT_TYPES, QuantPart, plan_layer, quantizable_layers

EMBEDDING = "token_embd.weight"
LM_HEAD = "output.weight"


def gguf_quant_plan(model: nn.Module, path: str | Path) -> tuple[dict[str, list[QuantPart]], bool]:
    """(parts of each linear kept in the file's blocks by module name, whether the embedding
    keeps its rows in blocks) for a model loading from the GGUF file at `path`."""
    checked = read_gguf_model(path)
    params = dict(model.named_parameters())
    layers = quantizable_layers(model)
    owner = {id(layer.weight): name for name, layer in layers.items()}
    types: dict[str, dict[Any, str]] = {}
    for info in checked.tensors.values():
        name = hf_name(info.name)
        if name is None or not name.endswith(".weight") or len(info.shape) != 2:
            continue
        target, shard_id = stacked_target(model, name)
        param = params.get(target)
        if param is not None and id(param) in owner:
            types.setdefault(owner[id(param)], {})[shard_id] = info.type
    plan = {}
    for name, qtypes in types.items():
        parts = plan_layer(layers[name], qtypes)
        if parts is not None:
            plan[name] = parts
    embedding = checked.tensors[EMBEDDING].type
    return plan, not model.cfg.tie_word_embeddings and embedding not in FLOAT_TYPES


def _kernel(isa: str | None = None) -> str:
    from cpud.native.quant import quant_kernel

    return f"{quant_kernel(isa)} int8 dot"


def describe_weights(model: nn.Module, isa: str | None = None) -> str:
    """One line: the formats of the model's linears and the kernel each runs, e.g.
    "weights: Q4_K x 96 linears, Q6_K x 16 (avx2 int8 dot), bf16 x 0; lm_head Q6_K"."""
    counts: Counter[str] = Counter()
    head = "dense"
    dense = 0
    for layer in model.modules():
        if not isinstance(layer, PackableLinear):
            continue
        formats = [w.qtype for _, w in layer.quant] if layer.quant is not None else []
        if isinstance(layer, ParallelLMHead):
            head = "+".join(formats) or "dense"
        elif formats:
            counts.update(formats)
        else:
            dense += 1
    quant = ", ".join(f"{q} x {n}" for q, n in counts.most_common())
    kernel = f" ({_kernel(isa)})" if counts or head != "dense" else ""
    table = getattr(getattr(model, "model", None), "embed_tokens", None)
    blocks = getattr(table, "row_blocks", None)
    embedding = blocks.qtype.name + " rows dequantized per token" if blocks is not None else "dense"
    return (
        f"weights: {quant or 'no quantized'} linears{kernel}, {dense} dense; "
        f"lm_head {head}; embedding {embedding}"
    )


def weight_formats(path: str | Path) -> list[tuple[str, int, str]]:
    """(format, matrices, kernel) of a GGUF file's weight matrices as cpud runs them with the
    native kernels: quantized GEMM on the blocks, or dequantized at load to a dense GEMM; the
    embedding is listed apart (format "embedding <type>")."""
    from cpud import native

    checked = read_gguf_model(path)
    fast = native.available()
    counts: Counter[str] = Counter()
    for name, info in checked.tensors.items():
        if len(info.shape) == 2 and name != EMBEDDING:
            counts[info.type] += 1
    if checked.config.tie_word_embeddings:
        counts[checked.tensors[EMBEDDING].type] += 1
    from cpud.native.quant import QTYPES

    rows = []
    for qtype, count in counts.most_common():
        kernel = _kernel() if fast and qtype in QTYPES else "dense GEMM (dequantized at load)"
        rows.append((qtype, count, kernel))
    embedding = checked.tensors[EMBEDDING].type
    tied_dense = checked.config.tie_word_embeddings and embedding not in QTYPES
    blocks = fast and embedding not in FLOAT_TYPES and not tied_dense
    rows.append((f"embedding {embedding}", 1, "rows dequantized per token" if blocks else "dense"))
    return rows
