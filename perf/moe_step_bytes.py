"""The bytes a decode step reads, by phase, as the kernels read them on this rank: each linear's
packed weight (bf16 panels or the quantized groups, padding rows included) and its bias, the
norms, the attention sinks, the KV rows each sequence attends to (its window on sliding
layers), the router, the gate_up / down blocks and biases of only the experts routed to, one
embedding row per token, the LM head, and the logits the sampler reads. Activations other than
the logits are left out (a few KiB a token).

perf/bench_moe.py divides these by its phase times; tests/test_moe_step_bytes.py checks them
against a tiny file's tensors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

PHASES = ("inputs", "embed", "layers", "final_norm", "lm_head", "sample")


def tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def linear_bytes(linear: Any) -> int:
    """A linear's weight as its GEMM streams it (quantized parts, packed bf16 or dense) and its
    bias (inside the packed weight, or kept apart where it is added after the all-reduce)."""
    if linear is None:
        return 0
    own_bias = tensor_bytes(getattr(linear, "bias", None))  # row-parallel: after the reduce
    if linear.quant is not None:
        return own_bias + sum(w.weight_bytes + tensor_bytes(w.bias) for _, w in linear.quant)
    if linear.packed is not None:
        return own_bias + linear.packed.weight_bytes + tensor_bytes(linear.packed.bias)
    return own_bias + tensor_bytes(linear.weight)


def expert_read_bytes(experts: Any) -> int:
    """One expert's gate_up and down weights (packed or in blocks) and biases on this rank."""
    stacks = experts.stacks()
    if stacks is None:  # torch kernels: the dense stacks
        stacks_bytes = tensor_bytes(experts.gate_up_proj) + tensor_bytes(experts.down_proj)
    else:
        stacks_bytes = sum(s.weight_bytes for s in stacks)
    biases = sum(tensor_bytes(b) for b in experts.biases())
    return (stacks_bytes + biases) // experts.num_experts


def embed_row_bytes(table: Any) -> int:
    """One row of the embedding table as the lookup reads it (blocks, packed or dense)."""
    if table.row_blocks is not None:
        data = table.row_blocks.data
        return data.nbytes // data.shape[0]
    weight = table.packed.data if table.packed is not None else table.weight
    return table.dim * weight.element_size()


def layer_bytes(weights: Any, sinks: torch.Tensor | None, routed: float) -> float:
    """A decoder layer's weights (DecoderLayerWeights; o's bias is o's) and attention sinks
    read in one step, with `routed` distinct experts."""
    norms = (weights.input_norm, weights.post_norm, weights.q_norm, weights.k_norm)
    norms += (weights.attn_out_norm, weights.ffn_out_norm, sinks)
    total = sum(tensor_bytes(t) for t in norms)
    total += sum(linear_bytes(lin) for lin in (weights.qkv, weights.o, weights.gate_up))
    total += linear_bytes(weights.down) + linear_bytes(weights.router)
    if weights.experts is not None:
        total += routed * expert_read_bytes(weights.experts)
    return total


def kv_read_bytes(kv_token_bytes: int, contexts: Sequence[float], window: int) -> float:
    """K and V rows of one layer the step's sequences attend to (`contexts`: each one's
    tokens, its new one included; `window`: 0 or the layer's sliding window)."""
    return kv_token_bytes * sum(min(c, window) if window else c for c in contexts)


def step_bytes(
    model: Any,
    routed: Sequence[float],
    contexts: Sequence[float],
    kv_token_bytes: int,
    logits_dtype: torch.dtype = torch.float32,
) -> dict[str, float]:
    """Bytes per phase (PHASES) of one decode step of len(contexts) sequences, one new token
    each; `routed`: the distinct experts each layer routed to (0 for a dense layer);
    `kv_token_bytes`: one token's K and V in one layer's cache. Means over several steps
    (fractional routed experts and contexts) give the mean step."""
    table = model.decoder_weights()
    layers = model.model.layers
    if len(routed) != len(layers):
        raise ValueError(f"routed: {len(routed)} layers, the model has {len(layers)}")
    total = 0
    for layer, weights, experts in zip(layers, table.layers, routed):
        sinks = getattr(layer.self_attn, "sinks", None)
        total += layer_bytes(weights, sinks, experts)
        total += kv_read_bytes(kv_token_bytes, contexts, weights.window)
    head = model.lm_head
    logits = head.vocab_size * torch.empty((), dtype=logits_dtype).element_size()
    return {
        "inputs": 0,
        "embed": len(contexts) * embed_row_bytes(model.model.embed_tokens),
        "layers": total,
        "final_norm": tensor_bytes(model.model.norm.weight),
        "lm_head": linear_bytes(head),
        "sample": len(contexts) * logits,
    }
