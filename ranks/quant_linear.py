"""Linears kept in their GGUF blocks, run by the native quantized GEMM (native/quant.py).

Where the native kernels run and a linear's tensors are in a type they compute on (Q8_0, Q4_0,
Q4_1, Q4_K, Q5_K, Q6_K, MXFP4), each rank takes its shard from the memory-mapped file as blocks
(rows for column-parallel and vocab-parallel layers, whole-block column ranges for
row-parallel ones; llama's Q/K permutation picks whole rows) and repacks it once with
``pack_quantized``; no dense copy of the matrix exists at any point. A fused linear whose
parts differ in type (Q4_K_M files keep attn_v in Q6_K in some layers) runs one GEMM per run
of equal types into its columns of the output. The embedding, when quantized, stays in the
file's blocks and dequantizes only the rows a step looks up.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from cpud.native.hugepages import HugeArena
from cpud.native.quant import QTYPES, ROWS, QuantWeight, pack_quantized
from cpud.ranks.gguf_blocks import Blocks
from cpud.ranks.gguf_experts import ExpertsQuant, expert_bytes, expert_layers, finish_experts
from cpud.ranks.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from cpud.ranks.layers.linear import ColumnParallelLinear, PackableLinear, RowParallelLinear
from cpud.ranks.layers.moe import SparseMoeBlock
from cpud.settings.errors import ConfigError

MAX_PARTS = 3  # CPUD_QPARTS: runs of one type per fused linear (q, k, v at most)


@dataclass(frozen=True)
class QuantPart:
    """Local output rows [offset, offset + n) of a layer, all in one native type."""

    offset: int
    qtype: str
    n: int
    k: int

    def shapes(self) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """Shapes of the packed quants and scales (pack_quantized's layout)."""
        _, bs, _, qbytes, sbytes = QTYPES[self.qtype]
        groups = -(-self.n // ROWS)
        return (groups, self.k // bs, qbytes), (groups, self.k // bs, sbytes)


def quantizable_layers(model: nn.Module) -> dict[str, PackableLinear]:
    """Every linear (LM head included) whose weight is still to be loaded, by module name;
    not the expert layers' routers: they stay dense (a quantized file's dequantized at load,
    as llama.cpp keeps ffn_gate_inp in F32), since the native MoE layer and the fused decoder
    run the router packed bf16. A router is a few KiB per layer."""
    routers = {id(m.gate) for m in model.modules() if isinstance(m, SparseMoeBlock)}
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, PackableLinear) and m.weight is not None and id(m) not in routers
    }


def _shard_rows(layer: PackableLinear, shard_id: Any) -> tuple[int, int]:
    """(first local row, rows) that the checkpoint tensor `shard_id` fills."""
    if isinstance(layer, ColumnParallelLinear):
        offset, _, size = layer.shard_rows(shard_id)
        return offset, size
    return 0, layer.weight.shape[0]


def plan_layer(layer: PackableLinear, qtypes: dict[Any, str]) -> list[QuantPart] | None:
    """The layer's parts when every tensor filling it has a native type that divides its K
    into whole blocks, else None (it stays dense)."""
    k = layer.weight.shape[1]
    spans = []
    for shard_id, qtype in qtypes.items():
        if qtype not in QTYPES or k % QTYPES[qtype][1]:
            return None
        spans.append((*_shard_rows(layer, shard_id), qtype))
    parts: list[QuantPart] = []
    for offset, size, qtype in sorted(spans):
        if parts and parts[-1].qtype == qtype and parts[-1].offset + parts[-1].n == offset:
            last = parts.pop()
            parts.append(QuantPart(last.offset, qtype, last.n + size, k))
        else:
            parts.append(QuantPart(offset, qtype, size, k))
    covered = sum(p.n for p in parts)
    if not parts or len(parts) > MAX_PARTS or covered != layer.weight.shape[0]:
        return None
    return parts


def cache_shapes(plan: dict[str, list[QuantPart]]) -> dict[str, tuple[int, ...]]:
    """Weight-cache entries (uint8) of the packed parts, by name."""
    out: dict[str, tuple[int, ...]] = {}
    for name, parts in plan.items():
        if isinstance(parts, ExpertsQuant):
            out.update((f"{name}.{suffix}", shape) for suffix, shape in parts.shapes().items())
            continue
        for i, part in enumerate(parts):
            out[f"{name}.q{i}.qs"], out[f"{name}.q{i}.sc"] = part.shapes()
    return out


def _store_blocks(
    layer: PackableLinear, keep: bool, param: nn.Parameter, source: Any, shard_id: Any = None
) -> None:
    if not hasattr(source, "blocks"):
        raise ConfigError(f"{type(layer).__name__}: quantized weights come from a GGUF file")
    if keep or isinstance(layer, ParallelLMHead):
        offset, rows, columns = layer.block_region(shard_id)
        layer.quant_blocks[offset] = source.blocks(rows, columns)


def _store_table(
    table: VocabParallelEmbedding, param: nn.Parameter, source: Any, shard_id: Any = None
) -> None:
    _, rows, _ = table.block_region(shard_id)
    table.row_blocks = source.blocks(rows) if table.rows else None


def begin_quant(
    model: nn.Module,
    plan: dict[str, list[QuantPart]],
    embedding_blocks: bool,
    cached: bool,
) -> None:
    """Before loading: the planned layers take their shard as blocks (only the LM head's when
    `cached`, for a tied embedding: the packed parts come from the weight cache); a quantized
    embedding keeps its rows in blocks."""
    modules = dict(model.named_modules())
    for name, parts in plan.items():
        layer = modules[name]
        layer.quant_plan = parts
        if isinstance(parts, ExpertsQuant):
            continue  # its loaders keep the GGUF sources (ranks/gguf_experts.py)
        layer.quant_blocks = {}
        layer.weight.weight_loader = functools.partial(_store_blocks, layer, not cached)
    if embedding_blocks:
        table = model.model.embed_tokens
        table.weight.weight_loader = functools.partial(_store_table, table)


def _rows(layer: PackableLinear, part: QuantPart) -> np.ndarray:
    """The raw [part.n, bytes per row] rows of a part from the blocks loaded; zero rows pad a
    vocab shard past the vocabulary."""
    picked = sorted(o for o in layer.quant_blocks if part.offset <= o < part.offset + part.n)
    chunks = []
    for offset in picked:
        blocks: Blocks = layer.quant_blocks[offset]
        if blocks.qtype.name != part.qtype or blocks.shape[1] != part.k:
            raise ConfigError(
                f"{type(layer).__name__}: blocks of {blocks.qtype.name} {blocks.shape} where "
                f"{part.qtype} with {part.k} columns was planned"
            )
        chunks.append(blocks.data)
    raw = np.concatenate(chunks) if len(chunks) > 1 else np.asarray(chunks[0])
    if raw.shape[0] < part.n:
        pad = np.zeros((part.n - raw.shape[0], raw.shape[1]), np.uint8)
        raw = np.concatenate([raw, pad])
    return raw


def finish_quant(
    model: nn.Module, cached: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """After loading: pack each planned layer's blocks (or take them from `cached`), drop the
    dense parameters; returns the packed tensors for the weight cache."""
    out: dict[str, torch.Tensor] = {}
    for name, experts in expert_layers(model).items():
        if experts.quant_plan is not None and experts.quant is None:
            out.update(finish_experts(name, experts, cached))
    layers = quantizable_layers(model)
    shapes = [s for lay in layers.values() for p in lay.quant_plan or () for s in p.shapes()]
    arena = HugeArena(HugeArena.size_of(shapes)) if cached is None and shapes else None
    for name, layer in layers.items():
        if layer.quant_plan is None:
            continue
        with_bias = not isinstance(layer, RowParallelLinear) and layer.bias is not None
        bias = layer.bias.data.float() if with_bias else None
        parts = []
        for i, part in enumerate(layer.quant_plan):
            b = None if bias is None else bias[part.offset : part.offset + part.n].contiguous()
            key = f"{name}.q{i}"
            if cached is not None:
                qs, sc = cached[f"{key}.qs"], cached[f"{key}.sc"]
                weight = QuantWeight(part.qtype, part.n, part.k, qs, sc, b)
            else:
                raw = _rows(layer, part)
                weight = pack_quantized(raw, part.qtype, part.n, part.k, b, alloc=arena.take)
            out[f"{key}.qs"], out[f"{key}.sc"] = weight.qs, weight.sc
            parts.append((part.offset, weight))
        layer.quant, layer.out_rows = parts, layer.weight.shape[0]
        if isinstance(layer, ParallelLMHead) and layer.tied_to:
            table = layer.tied_to[0]
            table.row_blocks = layer.quant_blocks.get(0) if table.rows else None
            table.weight = None
        layer.quant_blocks = None
        layer.weight = None
        if with_bias:
            layer.bias = None
    table = getattr(getattr(model, "model", None), "embed_tokens", None)
    if isinstance(table, VocabParallelEmbedding) and table.row_blocks is not None:
        table.weight = None
        release_file_pages(table.row_blocks.data)
    return out


def release_file_pages(view: np.ndarray) -> None:
    """Drop this process's pages of the file mapping behind `view` (a GGUF table kept in
    blocks): packing touched every page of the file, and only the rows a step looks up are
    needed again, faulted back from the page cache on use."""
    import mmap

    base = view
    while base is not None and not isinstance(base, np.memmap):
        base = getattr(base, "base", None)
    mapping = getattr(base, "_mmap", None)
    if isinstance(mapping, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
        try:
            mapping.madvise(mmap.MADV_DONTNEED)
        except (OSError, ValueError):
            pass  # only the resident figure is larger


def quant_bytes(model: nn.Module) -> int:
    """Bytes of the packed quantized weights the model holds."""
    return expert_bytes(model) + sum(
        w.weight_bytes
        for m in model.modules()
        if isinstance(m, PackableLinear) and m.quant is not None
        for _, w in m.quant
    )
