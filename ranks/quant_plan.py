"""Which linears of a model stay quantized, and how that is reported (startup log, doctor)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from torch import nn

from cpud.model.gguf_model import read_gguf_model
from cpud.model.gguf_names import hf_name
from cpud.model.model_config import ModelConfig
from cpud.model.quant_check import DENSE_TYPES, HEAD_TYPE
from cpud.native.quant_formats import FLOAT_TYPES, KERNEL_FORMATS
from cpud.ranks.checkpoint_targets import targets
from cpud.ranks.gguf_experts import expert_layers, expert_plans
from cpud.ranks.layers.embedding import ParallelLMHead
from cpud.ranks.layers.linear import PackableLinear
from cpud.ranks.models import registry
from cpud.ranks.quant_linear import QuantPart, plan_layer, quantizable_layers

EMBEDDING = "token_embd.weight"
LM_HEAD = "output.weight"
ROUTER = ".ffn_gate_inp.weight"  # dense at run time (quantizable_layers)


def gguf_quant_plan(model: nn.Module, path: str | Path) -> tuple[dict[str, list[QuantPart]], bool]:
    """(parts of each linear kept in the file's blocks by module name, whether the embedding
    keeps its rows in blocks) for a model loading from the GGUF file at `path`."""
    checked = read_gguf_model(path)
    params = dict(model.named_parameters())
    layers = quantizable_layers(model)
    owner = {id(layer.weight): name for name, layer in layers.items()}
    types: dict[str, dict[Any, str]] = {}
    for info in checked.tensors.values():
        name = hf_name(info.name, model.cfg.family)
        if name is None or not name.endswith(".weight") or len(info.shape) != 2:
            continue
        for target, shard_id, _ in targets(model, name):  # each part of a fused tensor
            param = params.get(target)
            if param is not None and id(param) in owner:
                types.setdefault(owner[id(param)], {})[shard_id] = info.type
    plan = {}
    for name, qtypes in types.items():
        parts = plan_layer(layers[name], qtypes)
        if parts is not None:
            plan[name] = parts
    plan.update(expert_plans(model, checked))
    embedding = checked.tensors[EMBEDDING].type
    return plan, not model.cfg.tie_word_embeddings and embedding not in FLOAT_TYPES


def _kernel(isa: str | None = None, qtype: str = "Q8_0") -> str:
    """e.g. "avx2 avx-vnni int8 dot", or on AMX "amx int8 dot (AMX-INT8 tiles from 16 rows,
    AMX-BF16 tiles from 64)" (the tiers and thresholds quant_gemm picks for qtype)."""
    from cpud.native.quant import bf16_tile_rows, quant_kernel

    name = quant_kernel(isa)
    if "+bf16" not in name:
        return f"{name} int8 dot"
    tiles = bf16_tile_rows(qtype.split(" ")[0], isa)
    return f"amx int8 dot (AMX-INT8 tiles from 16 rows, AMX-BF16 tiles from {tiles})"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"


def describe_weights(model: nn.Module, isa: str | None = None) -> str:
    """One line: each format of the model's linears with the kernel it runs and how many, e.g.
    "weights: Q4_K: avx2 int8 dot, 96 linears; Q6_K: avx2 int8 dot, 17 linears (lm_head);
    0 dense; embedding Q6_K rows dequantized per token"."""
    counts: Counter[str] = Counter()
    head: list[str] = []
    dense = 0
    for layer in model.modules():
        if not isinstance(layer, PackableLinear):
            continue
        formats = [w.qtype for _, w in layer.quant] if layer.quant is not None else []
        counts.update(dict.fromkeys(formats, 1))
        dense += not formats
        if isinstance(layer, ParallelLMHead):
            head = formats
    parts = [
        f"{q}: {_kernel(isa, q)}, {_plural(n, 'linear')}" + (" (lm_head)" if q in head else "")
        for q, n in counts.most_common()
    ]
    experts: Counter[str] = Counter()
    for layer in expert_layers(model).values():
        experts.update(s.qtype for s in layer.quant or ())
    parts += [f"{q}: {_plural(n, 'expert stack')}" for q, n in experts.most_common()]
    table = getattr(getattr(model, "model", None), "embed_tokens", None)
    blocks = getattr(table, "row_blocks", None)
    embedding = blocks.qtype.name + " rows dequantized per token" if blocks is not None else "dense"
    return f"weights: {'; '.join([*parts, f'{dense} dense'])}; embedding {embedding}"


def _linears_per_layer(cfg: ModelConfig) -> int:
    return registry.by_name(cfg.family).linears_per_layer


def _mxfp4_stacks(model_dir: str | Path, kept: bool) -> list[tuple[str, int, str]]:
    """The weight_formats row of a checkpoint's MXFP4 expert stacks (gpt-oss), if it has any:
    kept in their blocks, else dequantized at load."""
    from cpud.model.hf_mxfp4_experts import mxfp4_expert_stacks

    count = len(mxfp4_expert_stacks(model_dir))
    kernel = _kernel(None, "MXFP4") if kept else "dense GEMM (dequantized at load)"
    return [("MXFP4 expert stacks", count, kernel)] if count else []


def weight_formats(
    path: str | Path, quantization: str = "auto", cfg: ModelConfig | None = None
) -> list[tuple[str, int, str]]:
    """(format, matrices, kernel) of a model's weight matrices as cpud runs them on the native
    kernels under `quantization`: the int8 GEMM on blocks (a GGUF file's, or made at load), or
    a dense GEMM; the embedding is listed apart (format "embedding <type>"). `cfg`: the
    model's config, needed for a checkpoint directory."""
    from cpud import native

    fast = native.available()
    if not Path(path).is_file():
        if cfg is None:
            raise ValueError("weight_formats of a checkpoint directory needs its config")
        linears = cfg.num_layers * _linears_per_layer(cfg)
        experts = _mxfp4_stacks(path, fast and quantization == "auto")
        if quantization not in DENSE_TYPES or not fast:
            return [("dense", linears + (not cfg.tie_word_embeddings), "dense GEMM"), *experts]
        at_load = " (quantized at load)"
        return experts + [
            (
                DENSE_TYPES[quantization] + at_load,
                linears,
                _kernel(None, DENSE_TYPES[quantization]),
            ),
            (HEAD_TYPE + at_load, 1, _kernel(None, HEAD_TYPE)),
            (f"embedding {HEAD_TYPE}", 1, "rows dequantized per token"),
        ]
    checked = read_gguf_model(path)
    counts: Counter[str] = Counter()
    stacks: Counter[str] = Counter()
    for name, info in checked.tensors.items():
        if len(info.shape) == 2 and name != EMBEDDING:
            routed = name.endswith(ROUTER) and info.type not in FLOAT_TYPES
            counts[f"{info.type} router" if routed else info.type] += 1
        elif len(info.shape) == 3:
            stacks[info.type] += 1
    if checked.config.tie_word_embeddings:
        counts[checked.tensors[EMBEDDING].type] += 1
    blocks_run = fast and quantization == "auto"
    rows = []
    for qtype, count in counts.most_common():
        kernel = _kernel(None, qtype) if blocks_run and qtype in KERNEL_FORMATS else "dense GEMM"
        if kernel == "dense GEMM" and qtype not in FLOAT_TYPES:
            kernel += " (dequantized at load)"
        rows.append((qtype, count, kernel))
    for qtype, count in stacks.most_common():
        kept = blocks_run and qtype in KERNEL_FORMATS
        kernel = _kernel(None, qtype) if kept else "dense GEMM"
        if not kept and qtype not in FLOAT_TYPES:
            kernel += " (dequantized at load)"
        rows.append((f"{qtype} expert stacks", count, kernel))
    embedding = checked.tensors[EMBEDDING].type
    tied_dense = checked.config.tie_word_embeddings and embedding not in KERNEL_FORMATS
    blocks = blocks_run and embedding not in FLOAT_TYPES and not tied_dense
    rows.append((f"embedding {embedding}", 1, "rows dequantized per token" if blocks else "dense"))
    return rows
