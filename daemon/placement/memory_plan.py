"""Per-rank memory before anything loads: weight shard, KV cache and runtime against host RAM.

Each rank's budget is its share of its NUMA node's available memory (split evenly between the
ranks bound to that node; unbound ranks share all nodes), capped by its share of the room left
under the cgroup memory limit after the frontend. The KV cache is either an explicit size per
rank (--kv-cache-space / VLLM_CPU_KVCACHE_SPACE) or a fraction of what the budget leaves after
the weights and the runtime overhead (DEFAULT_KV_FRACTION unless given). Every rank gets the
same number of KV blocks: the frontend keeps one block table for all of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cpud.model.model_config import ModelConfig
from cpud.model.sizes import (
    divide,
    dtype_bytes,
    kv_block_bytes,
    moe_activation_elems,
    moe_expert_params,
    moe_extra_params,
    vocab_shard_size,
)
from cpud.placement.binding import BindingPlan
from cpud.placement.topology import Topology
from cpud.settings import DEFAULT_MAX_NUM_BATCHED_TOKENS, setting
from cpud.settings.errors import ConfigError

GiB = 1 << 30
MiB = 1 << 20

# Host RAM is shared with the page cache (which holds the checkpoint while it loads), other
# processes and the kernel, and running out means the OOM killer, not a retry: by default the
# KV cache takes half of what is left after weights and runtime.
DEFAULT_KV_FRACTION = 0.5
# Interpreter, torch, oneDNN scratch and allocator slack of one process (python + torch alone
# measure ~230 MiB resident).
RANK_RUNTIME_BYTES = 512 * MiB
FRONTEND_BYTES = 512 * MiB

KvSource = Literal["explicit", "fraction"]


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB"


def _gib_rounded(nbytes: float, up: bool) -> float:
    """A size in GiB with two decimals to suggest: rounded so that the suggestion still holds."""
    scaled = nbytes / GiB * 100
    return (math.ceil(scaled) if up else math.floor(scaled)) / 100


def _heads_local(model: ModelConfig, tp: int) -> tuple[int, int]:
    """(query heads, KV heads) per rank; KV heads are replicated when tp exceeds their count."""
    heads = divide(model.num_heads, tp, "num_attention_heads")
    if model.num_kv_heads >= tp:
        return heads, divide(model.num_kv_heads, tp, "num_key_value_heads")
    divide(tp, model.num_kv_heads, "tp over num_key_value_heads")
    return heads, 1


def shard_param_count(model: ModelConfig, tp: int) -> int:
    """Parameters one rank holds under cpud's Megatron sharding (the same for every rank).

    Column-parallel qkv/gate/up and row-parallel o/down hold 1/tp; the vocab-parallel embedding
    and lm_head hold a 1/tp slice of the vocabulary padded to a multiple of 64; norms, biases
    of row-parallel layers and OPT's position table are replicated; a tied lm_head is the
    embedding and counts once.
    """
    h, hd, layers = model.hidden_size, model.head_dim, model.num_layers
    heads, kv_heads = _heads_local(model, tp)
    inter = divide(model.intermediate_size, tp, "intermediate_size")
    q, kv = heads * hd, kv_heads * hd
    vocab = vocab_shard_size(model.vocab_size, tp)
    if not model.generates:  # an encoder: biases everywhere, LayerNorms, no LM head
        layer = h * 3 * q + 3 * q + q * h + h + 2 * h * inter + inter + h + 2 * 2 * h
        types = model.type_vocab_size
        return vocab * h + (model.max_position_embeddings + types + 2) * h + layers * layer
    if model.family == "opt":
        dim = model.word_embed_proj_dim or h
        bias = model.enable_bias
        layer = sum(
            (
                h * 3 * q + 3 * q * bias,  # qkv_proj
                q * h + h * bias,  # out_proj
                h * inter + inter * bias,  # fc1
                inter * h + h * bias,  # fc2
                2 * 2 * h,  # two LayerNorms
            )
        )
        total = vocab * dim + (model.max_position_embeddings + 2) * h + layers * layer
        total += 2 * dim * h if dim != h else 0  # project_in / project_out
        total += 2 * h if model.do_layer_norm_before else 0  # final LayerNorm
    else:
        layer = sum(
            (
                h * (q + 2 * kv) + (q + 2 * kv) * model.qkv_bias,  # qkv_proj
                q * h + h * model.o_bias,  # o_proj (bias replicated)
                2 * hd * model.qk_norm,  # q_norm, k_norm
                h * 2 * inter + inter * h,  # gate_up_proj, down_proj
                2 * h,  # input and post-attention RMSNorm
            )
        )
        dim = h
        total = vocab * h + layers * layer + h  # embedding, layers, final norm
        total += moe_extra_params(model, tp)  # every expert of every expert layer
    if not model.tie_word_embeddings:
        total += vocab * dim
    return total


def weight_bytes(model: ModelConfig, dtype: str, tp: int) -> int:
    """Bytes of one rank's weight shard."""
    return shard_param_count(model, tp) * dtype_bytes(dtype)


def quantized_weight_bytes(
    model: ModelConfig, dtype: str, tp: int, model_dir: str | Path, quantization: str
) -> int:
    """Bytes of one rank's weight shard as it stays resident: a GGUF file's quantized matrices
    at their size in the file under --quantization auto (a tied quantized table counts twice:
    the file's rows for lookups and the LM head's packed copy), the linears in their block
    type and the LM head and the table in Q8_0 under q8_0|q4_0|q4_k; a checkpoint's MXFP4
    expert stacks (gpt-oss) at their size under auto; the rest in `dtype`."""
    from cpud.model.quant_check import BLOCKS, DENSE_TYPES, HEAD_TYPE, quantized_bytes

    size = dtype_bytes(dtype)
    dense = weight_bytes(model, dtype, tp)
    if quantization in DENSE_TYPES:
        table = vocab_shard_size(model.vocab_size, tp) * model.hidden_size
        linears = shard_param_count(model, tp) - table * (2 - model.tie_word_embeddings)
        linears -= model.num_layers * 4 * model.hidden_size  # norms and biases stay dense
        linears -= moe_expert_params(model, tp)  # experts stay in dtype (linears only)
        quant = quantized_bytes(linears, DENSE_TYPES[quantization])
        return (
            dense
            - (linears + table * (2 - model.tie_word_embeddings)) * size
            + (quant + 2 * quantized_bytes(table, HEAD_TYPE))
        )
    if quantization != "auto":
        return dense
    if not Path(model_dir).is_file():  # MXFP4 expert stacks stay in their blocks (gpt-oss)
        from cpud.model.hf_mxfp4_experts import mxfp4_expert_stacks

        stacks = mxfp4_expert_stacks(model_dir)
        return dense + sum(-(-s.nbytes // tp) - s.values // tp * size for s in stacks)
    from cpud.model.gguf_model import read_gguf_model

    checked = read_gguf_model(model_dir)
    total = dense
    for name, info in checked.tensors.items():
        if len(info.shape) not in (2, 3) or info.type not in BLOCKS:
            continue  # 3-D: expert stacks, kept in blocks too (ranks/gguf_experts.py)
        total += -(-info.n_bytes // tp) - math.prod(info.shape) // tp * size
        if name == "token_embd.weight" and model.tie_word_embeddings:
            total += -(-info.n_bytes // tp)
    return total


def overhead_bytes(
    model: ModelConfig,
    dtype: str,
    tp: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
) -> int:
    """An upper estimate of a rank's memory beyond weights and KV cache: the process runtime,
    RoPE tables, one layer's activations for a full token budget (fp32) and gathered logits."""
    heads, kv_heads = _heads_local(model, tp)
    inter = model.intermediate_size // tp
    rope = 2 * max_model_len * model.rotary_dim * dtype_bytes(dtype)
    if model.recipe is None:  # no RoPE tables (OPT's learned positions, encoders)
        rope = 0
    per_token = 4 * model.hidden_size + (heads + 2 * kv_heads) * model.head_dim + 3 * inter
    per_token += moe_activation_elems(model, tp)
    activations = max_num_batched_tokens * per_token * 4
    logits = max_num_seqs * vocab_shard_size(model.vocab_size, 1) * 4 if model.generates else 0
    return RANK_RUNTIME_BYTES + rope + activations + logits


@dataclass(frozen=True)
class RankMemory:
    rank: int
    numa_node: int | None
    weight_bytes: int
    kv_bytes: int
    overhead_bytes: int
    # This rank's share of the memory it may use (node share, capped by its cgroup share).
    budget_bytes: int
    # Where the budget comes from, for messages ("NUMA node 1: 9.40 GiB available, ...").
    budget_source: str

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.overhead_bytes


@dataclass(frozen=True)
class MemoryPlan:
    ranks: tuple[RankMemory, ...]
    block_size: int
    kv_block_bytes: int
    num_kv_blocks: int
    kv_source: KvSource
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype the blocks are sized for

    @property
    def kv_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def describe(self) -> list[str]:
        lines = [
            f"rank {r.rank}: weights {_gib(r.weight_bytes)} + KV cache {_gib(r.kv_bytes)} + "
            f"runtime {_gib(r.overhead_bytes)} = {_gib(r.total_bytes)} of {_gib(r.budget_bytes)}"
            f" ({r.budget_source})"
            for r in self.ranks
        ]
        elements = "model dtype" if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
        lines.append(
            f"KV cache: {self.num_kv_blocks} blocks of {self.block_size} tokens "
            f"({self.kv_tokens} tokens, {self.kv_source}; {elements}, "
            f"{self.kv_block_bytes // self.block_size} bytes per token)"
        )
        lines += [f"warning: {w}" for w in self.warnings]
        lines += [f"note: {n}" for n in self.notes]
        return lines


def _budgets(binding: BindingPlan, topology: Topology) -> list[tuple[int, str]]:
    """(bytes, description) of each rank's share of the memory it may use."""
    tp = binding.tp
    cgroup = None
    if topology.cgroup_memory_available is not None:
        room = max(0, topology.cgroup_memory_available - FRONTEND_BYTES)
        cgroup = (
            room // tp,
            f"cgroup limit {_gib(topology.cgroup_memory_limit or 0)}, "
            f"{_gib(topology.cgroup_memory_available)} free, shared by {tp} rank(s) "
            f"and the frontend",
        )
    budgets = []
    for rank in binding.ranks:
        if rank.numa_node is None:
            total = sum(n.mem_available for n in topology.nodes if n.mem_allowed)
            share = (total // tp, f"all nodes: {_gib(total)} available, shared by {tp} rank(s)")
        else:
            node = topology.node(rank.numa_node)
            sharing = binding.ranks_on_node(node.id)
            share = (
                node.mem_available // sharing,
                f"NUMA node {node.id}: {_gib(node.mem_available)} available"
                + (f", shared by {sharing} ranks" if sharing > 1 else ""),
            )
        budgets.append(min(share, cgroup) if cgroup is not None else share)
    return budgets


def _kv_fraction(
    kv_cache_fraction: float | None, gpu_memory_utilization: float | None, warnings: list[str]
) -> tuple[float, str]:
    """(fraction, the flag that set it)."""
    if kv_cache_fraction is not None and gpu_memory_utilization is not None:
        raise ConfigError(
            "--kv-cache-fraction and --gpu-memory-utilization are the same setting: give one"
        )
    if gpu_memory_utilization is not None:
        warnings.append(
            "--gpu-memory-utilization is read as the KV cache fraction: on CPU it is the share "
            "of host RAM (each NUMA node's available memory after weights and runtime) given "
            "to the KV cache"
        )
        kv_cache_fraction = gpu_memory_utilization
        name = "--gpu-memory-utilization"
    else:
        name = "--kv-cache-fraction"
    if kv_cache_fraction is None:
        return DEFAULT_KV_FRACTION, name
    if isinstance(kv_cache_fraction, bool) or not 0 < kv_cache_fraction <= 1:
        raise ConfigError(f"{name} must be in (0, 1], got {kv_cache_fraction!r}")
    return float(kv_cache_fraction), name


def plan_memory(
    model: ModelConfig,
    dtype: str,
    binding: BindingPlan,
    topology: Topology,
    *,
    max_model_len: int,
    block_size: int = setting("block_size").default,
    max_num_seqs: int = setting("max_num_seqs").default,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    kv_cache_space_gib: float | None = None,
    kv_cache_fraction: float | None = None,
    gpu_memory_utilization: float | None = None,
    weights: int | None = None,
    kv_cache_dtype: str = "auto",
    draft_block_bytes: int = 0,
) -> MemoryPlan:
    """Size every rank's memory, or raise ConfigError with the numbers and what would fit.
    `weights`: one rank's weight bytes where not `dtype` throughout (quantized_weight_bytes).
    `kv_cache_dtype`: the KV cache's element type (--kv-cache-dtype; auto: dtype).
    `draft_block_bytes`: what a speculative draft model's KV adds to each block."""
    tp = binding.tp
    warnings: list[str] = []
    notes: list[str] = []
    fraction, fraction_flag = _kv_fraction(kv_cache_fraction, gpu_memory_utilization, warnings)
    if kv_cache_space_gib is not None:
        if isinstance(kv_cache_space_gib, bool) or kv_cache_space_gib <= 0:
            raise ConfigError(f"--kv-cache-space must be positive GiB, got {kv_cache_space_gib!r}")
        if kv_cache_fraction is not None or gpu_memory_utilization is not None:
            warnings.append("the KV cache fraction is ignored: --kv-cache-space sets the size")

    weights = weight_bytes(model, dtype, tp) if weights is None else weights
    overhead = overhead_bytes(model, dtype, tp, max_model_len, max_num_batched_tokens, max_num_seqs)
    # An encoder keeps no KV cache: its blocks are bookkeeping only and take no memory.
    block_bytes = (
        kv_block_bytes(model, tp, block_size, dtype, kv_cache_dtype) + draft_block_bytes
        if model.generates
        else 0
    )
    blocks_per_seq = -(-max_model_len // block_size)
    budgets = _budgets(binding, topology)

    # The rank with the least room for KV decides for all of them.
    tight = min(range(tp), key=lambda r: budgets[r][0])
    budget, source = budgets[tight]
    room = budget - weights - overhead
    where = binding.ranks[tight].numa_node
    who = f"rank {tight}" + ("" if where is None else f" on NUMA node {where}")

    def most_tokens(kv_bytes: int) -> int:
        return max(0, kv_bytes // block_bytes) * block_size

    if room <= 0:
        raise ConfigError(
            f"{who} needs {_gib(weights)} for its weight shard + {_gib(overhead)} runtime = "
            f"{_gib(weights + overhead)} before any KV cache, but has {_gib(budget)} ({source}): "
            f"free memory, choose a smaller --dtype, or raise --tp to spread the weights"
        )

    if not block_bytes:
        kv_source: KvSource = "explicit" if kv_cache_space_gib is not None else "fraction"
        num_blocks = blocks_per_seq * max_num_seqs
    elif kv_cache_space_gib is not None:
        kv_source = "explicit"
        wanted = int(kv_cache_space_gib * GiB)
        if wanted > room:
            largest = _gib_rounded(room, up=False)
            fit = most_tokens(int(largest * GiB))
            raise ConfigError(
                f"{who} needs {_gib(weights)} weights + {_gib(wanted)} KV cache + "
                f"{_gib(overhead)} runtime = {_gib(weights + wanted + overhead)}, but has "
                f"{_gib(budget)} ({source}): lower --kv-cache-space to {largest:.2f} GiB or less "
                f"(that holds {fit} tokens: max_model_len up to "
                f"{min(fit, model.max_position_embeddings)})"
            )
        num_blocks = wanted // block_bytes
    else:
        kv_source = "fraction"
        num_blocks = int(room * fraction) // block_bytes

    # More blocks than every sequence at full length could use would only hold stale prefixes.
    cap = blocks_per_seq * max_num_seqs
    if num_blocks > cap:
        notes.append(
            f"KV cache capped at {cap} blocks: {max_num_seqs} sequences of {max_model_len} "
            f"tokens cannot use more"
        )
        num_blocks = cap
    if num_blocks < blocks_per_seq:
        held = num_blocks * block_size
        needed = blocks_per_seq * block_bytes
        if kv_source == "explicit":
            what = f"KV cache of {_gib(wanted)} per rank"
            grow_to = _gib_rounded(needed, up=True)
            grows = grow_to * GiB <= room
            grow = f"raise --kv-cache-space to {grow_to:.2f} GiB"
        else:
            what = (
                f"KV cache of {fraction:g} x the {_gib(room)} left for {who} after weights "
                f"{_gib(weights)} and runtime {_gib(overhead)} ({source})"
            )
            grow_to = math.ceil(needed / room * 100) / 100
            grows = grow_to <= 1
            grow = f"raise {fraction_flag} to {grow_to:g}"
        if grows:
            hint = grow + (f" or lower --max-model-len to {held}" if held else "")
        else:
            hint = (
                f"lower --max-model-len to {held or most_tokens(room)} (at most "
                f"{most_tokens(room)} with all "
                f"{_gib(room)} left after weights and runtime), or free memory"
            )
        raise ConfigError(
            f"{what} holds {held} tokens, fewer than max_model_len {max_model_len}: {hint}"
        )

    kv_bytes = num_blocks * block_bytes
    ranks = tuple(
        RankMemory(
            rank=placement.rank,
            numa_node=placement.numa_node,
            weight_bytes=weights,
            kv_bytes=kv_bytes,
            overhead_bytes=overhead,
            budget_bytes=budgets[placement.rank][0],
            budget_source=budgets[placement.rank][1],
        )
        for placement in binding.ranks
    )
    return MemoryPlan(
        ranks,
        block_size,
        block_bytes,
        num_blocks,
        kv_source,
        tuple(warnings),
        tuple(notes),
        kv_cache_dtype,
    )
