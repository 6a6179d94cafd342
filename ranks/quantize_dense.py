"""Quantize a dense checkpoint at load (--quantization q8_0|q4_0|q4_k) into GGUF blocks.

Each rank loads its shard dense, then every linear becomes blocks of the chosen type (the LM
head, and the embedding table, Q8_0: the layer that decides every token keeps 8 bits, as
llama.cpp keeps its output layer at 6 bits or more) and is repacked by ``pack_quantized`` for
the int8 GEMM; the dense copy is dropped. The packed parts (and the table's raw rows) go to
the weight cache, so a later start maps them and reads no dense weight at all.

Rounding: Q8_0 and Q4_0 as llama.cpp's reference quantizers (Q8_0: d = amax / 127, q = round
half away from zero of x / d; Q4_0: d = the value of largest magnitude / -8, q = min(15,
floor(x / d + 8.5))). Q4_K: per 32 values a scale and a minimum fitted by least squares on
the rounded levels (a few rounds from the min/max fit), the 8 scales and 8 minimums of a
256 super-block then quantized to 6 bits under two fp16 super-scales.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from cpud.model.quant_check import DENSE_TYPES, HEAD_TYPE
from cpud.native.quant import QTYPES, QuantWeight, pack_quantized
from cpud.ranks.gguf_blocks import Blocks
from cpud.ranks.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from cpud.ranks.layers.linear import PackableLinear, RowParallelLinear
from cpud.ranks.quant_linear import QuantPart, quantizable_layers
from cpud.settings.errors import ConfigError

TABLE = "model.embed_tokens"
_FIT_ROUNDS = 4


def _round_away(x: np.ndarray) -> np.ndarray:
    """C's roundf: halves away from zero."""
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def _f16_bytes(d: np.ndarray) -> np.ndarray:
    """[...] float -> [..., 2] u8 of its fp16 bits."""
    return d.astype(np.float16)[..., None].view(np.uint8)


def _inverse(d: np.ndarray) -> np.ndarray:
    return np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)


def _q8_0(x: np.ndarray) -> np.ndarray:
    """[rows, nb, 32] fp32 -> [rows, nb, 34] Q8_0 blocks."""
    d = np.abs(x).max(axis=-1) / 127
    q = _round_away(x * _inverse(d)[..., None]).astype(np.int8).view(np.uint8)
    return np.concatenate([_f16_bytes(d), q], axis=-1)


def _q4_0(x: np.ndarray) -> np.ndarray:
    """[rows, nb, 32] fp32 -> [rows, nb, 18] Q4_0 blocks."""
    pick = np.abs(x).argmax(axis=-1)[..., None]
    d = np.take_along_axis(x, pick, axis=-1)[..., 0] / -8
    q = np.minimum(15, np.floor(x * _inverse(d)[..., None] + 8.5)).astype(np.uint8)
    nib = q[..., :16] | (q[..., 16:] << 4)
    return np.concatenate([_f16_bytes(d), nib], axis=-1)


def _fit_scale_min(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., 32] -> (scale, m >= 0) of x ~ scale * q - m with q in 0..15, least squares."""
    lo = np.minimum(x.min(axis=-1), 0.0)
    scale = (x.max(axis=-1) - lo) / 15
    m = -lo
    for _ in range(_FIT_ROUNDS):
        q = np.clip(_round_away((x + m[..., None]) * _inverse(scale)[..., None]), 0, 15)
        n = x.shape[-1]
        sq, sqq, sx, sqx = q.sum(-1), (q * q).sum(-1), x.sum(-1), (q * x).sum(-1)
        det = n * sqq - sq * sq
        ok = det > 0
        new_scale = np.where(ok, (n * sqx - sq * sx) / np.where(ok, det, 1), scale)
        new_m = np.where(ok, (sq * new_scale - sx) / n, m)
        good = ok & (new_scale > 0) & (new_m >= 0)
        scale, m = np.where(good, new_scale, scale), np.where(good, new_m, m)
    return scale, m


def _six_bits(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., 8] >= 0 -> (super-scale [...], 6-bit levels [..., 8]) with levels * super ~ values."""
    top = values.max(axis=-1) / 63
    levels = np.clip(_round_away(values * _inverse(top)[..., None]), 0, 63).astype(np.uint8)
    return top, levels


def _q4_k(x: np.ndarray) -> np.ndarray:
    """[rows, nb, 256] fp32 -> [rows, nb, 144] Q4_K blocks."""
    sub = x.reshape(*x.shape[:-1], 8, 32)
    scale, m = _fit_scale_min(sub)
    d, sc = _six_bits(scale)
    dmin, mn = _six_bits(m)
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    eff_scale = d[..., None] * sc
    eff_min = dmin[..., None] * mn
    q = _round_away((sub + eff_min[..., None]) * _inverse(eff_scale)[..., None])
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(*x.shape[:-1], 4, 2, 32)
    qs = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(*x.shape[:-1], 128)
    packed = np.zeros((*x.shape[:-1], 12), np.uint8)
    packed[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), packed, qs], axis=-1)


_QUANTIZERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_K": _q4_k}
_ROWS_PER_PASS = 256


def quantize_blocks(weight: torch.Tensor | np.ndarray, qtype: str) -> np.ndarray:
    """W [n, k] (any float dtype) -> [n, bytes per row] u8 in GGUF `qtype` (Q8_0, Q4_0, Q4_K)."""
    _, bs, tsize, _, _ = QTYPES[qtype]
    w = weight.float().numpy() if isinstance(weight, torch.Tensor) else np.asarray(weight)
    n, k = w.shape
    if k % bs:
        raise ValueError(f"{qtype}: {k} columns are not a multiple of {bs}")
    out = np.empty((n, k // bs * tsize), np.uint8)
    for r0 in range(0, n, _ROWS_PER_PASS):
        rows = w[r0 : r0 + _ROWS_PER_PASS].astype(np.float32).reshape(-1, k // bs, bs)
        out[r0 : r0 + len(rows)] = _QUANTIZERS[qtype](rows).reshape(len(rows), -1)
    return out


def dense_plan(model: nn.Module, quantization: str) -> dict[str, list[QuantPart]]:
    """One part per linear: the --quantization type, Q8_0 for the LM head."""
    qtype = DENSE_TYPES[quantization]
    plan = {}
    for name, layer in quantizable_layers(model).items():
        n, k = layer.weight.shape
        kind = HEAD_TYPE if isinstance(layer, ParallelLMHead) else qtype
        if k % QTYPES[kind][1]:
            raise ConfigError(f"--quantization {quantization}: {name} has K={k}")
        plan[name] = [QuantPart(0, kind, n, k)]
    return plan


def begin_dense_quant(model: nn.Module, plan: dict[str, list[QuantPart]]) -> None:
    """Before loading: the planned layers load dense (not packed for the bf16 GEMM)."""
    modules = dict(model.named_modules())
    for name, parts in plan.items():
        modules[name].quant_plan = parts


def dense_weight_names(model: nn.Module, plan: dict[str, list[QuantPart]]) -> frozenset[str]:
    """Parameter names of the planned layers' weights and the embedding table: what a start
    from the weight cache does not read."""
    modules = dict(model.named_modules())
    ids = {id(modules[name].weight) for name in plan}
    table = getattr(model.model, "embed_tokens", None)
    if isinstance(table, VocabParallelEmbedding) and table.rows:
        ids.add(id(table.weight))
    return frozenset(name for name, p in model.named_parameters() if id(p) in ids)


def dense_cache_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Weight-cache entries (uint8) beyond the packed parts: the embedding's raw Q8_0 rows."""
    table = getattr(model.model, "embed_tokens", None)
    if not isinstance(table, VocabParallelEmbedding) or not table.rows:
        return {}
    _, bs, tsize, _, _ = QTYPES[HEAD_TYPE]
    return {f"{TABLE}.rows": (table.rows, table.dim // bs * tsize)}


def _table_blocks(raw: Any, table: VocabParallelEmbedding) -> Blocks:
    data = raw.numpy() if isinstance(raw, torch.Tensor) else raw
    return Blocks(GGMLQuantizationType.Q8_0, data[: table.rows], (table.rows, table.dim))


def finish_dense_quant(
    model: nn.Module,
    plan: dict[str, list[QuantPart]],
    cached: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """After loading: quantize and pack each planned layer (or take it from `cached`), the
    embedding table to Q8_0 rows; drop the dense weights. Returns the weight-cache tensors."""
    out: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    table = getattr(model.model, "embed_tokens", None)
    table_key = f"{TABLE}.rows"
    for name, parts in plan.items():
        layer: PackableLinear = modules[name]
        (part,) = parts
        with_bias = not isinstance(layer, RowParallelLinear) and layer.bias is not None
        bias = layer.bias.data.float().contiguous() if with_bias else None
        key = f"{name}.q0"
        if cached is not None:
            weight = QuantWeight(
                part.qtype, part.n, part.k, cached[f"{key}.qs"], cached[f"{key}.sc"], bias
            )
        else:
            raw = quantize_blocks(layer.weight.data, part.qtype)
            weight = pack_quantized(raw, part.qtype, part.n, part.k, bias)
            if isinstance(layer, ParallelLMHead) and layer.tied_to and table is not None:
                out[table_key] = torch.from_numpy(np.ascontiguousarray(raw[: table.rows]))
        out[f"{key}.qs"], out[f"{key}.sc"] = weight.qs, weight.sc
        layer.quant, layer.out_rows = [(0, weight)], part.n
        layer.quant_plan = [part]
        layer.weight = None
        if with_bias:
            layer.bias = None
    if isinstance(table, VocabParallelEmbedding) and table.rows:
        if cached is not None:
            table.row_blocks = _table_blocks(cached[table_key], table)
        else:
            if table_key not in out:
                raw = quantize_blocks(table.weight.data[: table.rows], HEAD_TYPE)
                out[table_key] = torch.from_numpy(raw)
            table.row_blocks = _table_blocks(out[table_key], table)
        table.weight = None
    return out
