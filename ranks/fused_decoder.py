"""A recipe decoder's layers as one native call per step (native/drivers/decoder.c).

The per-op path crosses from Python into C a dozen times per layer (norms, GEMMs, rotary, KV
write, attention, all-reduces), with argument checks and tensor views in between: about 10 ms of
a 49 ms decode-1 step on qwen3-0.6b. Here the layer stack runs as one call over a table of
weight and cache addresses built once; embedding, final norm, LM head and sampling stay in
Python. Same kernels in the same order as ranks/models/decoder.py, so the same tokens; the
model's DecoderRecipe (norm rounding, sandwich norms, activation, per-layer RoPE table and
window, residual multiplier) travels as data in the dims and layer tables.

The model hands over its shape and weights through ``decoder_weights()``
(ranks/models/decoder_weights.py). Expert layers (ranks/models/moe.py) run router, routing and
experts in the same call (native/drivers/moe.c).

Used where the model is a DecoderForCausalLM whose linears are each packed (native bf16) or kept
quantized (ranks/quant_linear.py: the quantized GEMM, bf16 or fp32 activations), its experts
packed (bf16), and the TP
group is a single rank or the shared-memory group; otherwise (torch kernels, dense fp32, OPT,
gloo) the per-op path runs and `unsupported_reason` says why.
"""

from __future__ import annotations

from typing import Any

import torch

from cpud.native.kernels import DTYPE_CODE, KV_DTYPE_CODE, check_rc
from cpud.ranks.models.decoder import DecoderForCausalLM, KVCache
from cpud.ranks.ops import Ops
from cpud.ranks.paged_kv import AttentionMetadata
from cpud.ranks.parallel import TPGroup

# Steps of at most this many tokens keep their scratch rows for the next step of the same size.
DECODE_BUFFER_TOKENS = 256
_INDEX_DTYPES = (
    ("positions", torch.int64),
    ("slot_mapping", torch.int64),
    ("query_start_loc", torch.int32),
    ("seq_lens", torch.int32),
    ("block_tables", torch.int32),
)


def _inner_group(group: TPGroup) -> TPGroup:
    """The group under a TimedGroup wrapper (ranks/stats.py), else the group itself."""
    return getattr(group, "group", group)


def unsupported_reason(model: Any, ops: Ops, group: TPGroup) -> str | None:
    """Why `model` cannot run fused under these ops and group; None when it can."""
    from cpud.native import ShmGroup

    if ops.name != "native":
        return f"kernels are {ops.name!r}, not native"
    if not isinstance(model, DecoderForCausalLM):
        return f"{type(model).__name__} is not a recipe decoder"
    if model.cfg.shared_expert_intermediate_size:
        return "shared experts (Qwen2-MoE) run op by op"
    for layer in model.decoder_weights().layers:
        if layer.experts is not None:
            if layer.experts.stacks() is None:
                return "experts are neither packed for the native GEMM (bf16) nor kept quantized"
            if layer.router.packed is None:
                return "the experts' router is not packed for the native GEMM (bf16)"
            linears = (layer.qkv, layer.o)
        else:
            linears = (layer.qkv, layer.o, layer.gate_up, layer.down)
        if any(lin.packed is None and lin.quant is None for lin in linears):
            return "weights are not packed for the native GEMM (bf16) nor kept quantized"
    inner = _inner_group(group)
    if group.size > 1 and not isinstance(inner, ShmGroup):
        return f"tensor-parallel group is {type(inner).__name__}, not the shared-memory group"
    return None


class FusedDecoder:
    """Runs `model`'s decoder layers with one native call per step (see the module doc)."""

    def __init__(
        self,
        model: DecoderForCausalLM,
        ops: Any,
        group: TPGroup,
        kv_caches: list[KVCache],
        dtype: torch.dtype | None = None,
    ):
        """dtype: the activations' (default: the KV caches', which must then be float32 or
        bfloat16); the caches may hold bf16 or quantized rows (ranks/paged_kv.py)."""
        from cpud.native import _loader

        reason = unsupported_reason(model, ops, group)
        if reason is not None:
            raise ValueError(f"fused decoder: {reason}")
        self._ffi, self._lib = _loader.ffi, _loader.lib
        self._isa = _loader.ISAS.index(ops.k.isa)
        self.group = group
        inner = _inner_group(group)
        self._shm = inner if group.size > 1 else None
        table = model.decoder_weights()
        self.table = table
        cache_dtype = kv_caches[0][0].dtype
        dtype = cache_dtype if dtype is None else dtype
        if dtype not in DTYPE_CODE:
            raise ValueError(f"fused decoder: dtype {dtype} is not float32 or bfloat16")
        if cache_dtype not in KV_DTYPE_CODE or cache_dtype not in (dtype, torch.bfloat16):
            if cache_dtype not in (torch.int8, torch.float8_e5m2, torch.float8_e4m3fn):
                raise ValueError(f"fused decoder: a {cache_dtype} KV cache under {dtype}")
        self.dtype = dtype
        self.cache_dtype = cache_dtype
        self.hidden = model.cfg.hidden_size
        self.q_dim = table.heads * table.head_dim
        self.qkv_dim = table.q_size + 2 * table.kv_size
        self.intermediate = table.intermediate
        num_blocks, _, block_size, _ = kv_caches[0][0].shape
        dims = self._ffi.new("cpud_decoder_dims *")
        dims.dtype = DTYPE_CODE[dtype]
        dims.hidden = self.hidden
        dims.heads = table.heads
        dims.kv_heads = table.kv_heads
        dims.head_dim = table.head_dim
        dims.rot_dim = table.rotary_dim
        dims.intermediate = self.intermediate
        dims.max_pos = table.max_positions
        dims.num_blocks = num_blocks
        dims.block_size = block_size
        dims.eps = table.eps
        dims.scale = table.scale
        self.norm_dtype = table.layers[0].input_norm.dtype
        dims.norm_wdt = DTYPE_CODE[self.norm_dtype]
        dims.activation = 1 if table.gelu else 0
        dims.rotary_neox = 1
        dims.residual_scale = table.residual_scale
        dims.kv_dtype = KV_DTYPE_CODE[cache_dtype]
        dims.quant_flags = 0
        self._dims = dims
        self._keep: list[torch.Tensor] = []  # everything whose address the tables hold
        # bytes of weights the dense linears read per step, and their time summed over steps
        self.linear_bytes = 0
        self.linear_seconds = 0.0
        self.team_steps = 0  # steps run as one native thread team (decode)
        # the attention sinks [heads] fp32 of each layer, where it has them (gpt-oss)
        sinks = [getattr(layer.self_attn, "sinks", None) for layer in model.model.layers]
        self._layers = self._layer_table(kv_caches, sinks)
        self._peer = self._ffi.new("int *")
        self._kept: tuple[torch.Tensor, ...] | None = None  # _buffers' rows of the last step

    def _addr(self, t: torch.Tensor | None, dtype: torch.dtype | None = None) -> int:
        if t is None:
            return 0
        if not t.is_contiguous() or (dtype is not None and t.dtype != dtype):
            raise ValueError(f"fused decoder: expected a contiguous {dtype} tensor, got {t.dtype}")
        self._keep.append(t)
        return t.data_ptr()

    def _layer_table(self, kv_caches: list[KVCache], sinks: list[torch.Tensor | None]) -> Any:
        layers = self.table.layers
        table = self._ffi.new("cpud_decoder_layer[]", len(layers))
        for entry, layer, (key_cache, value_cache), layer_sinks in zip(
            table, layers, kv_caches, sinks
        ):
            norms = self.norm_dtype
            entry.input_norm = self._addr(layer.input_norm, norms)
            entry.post_norm = self._addr(layer.post_norm, norms)
            if layer.q_norm is not None:
                entry.q_norm = self._addr(layer.q_norm, norms)
                entry.k_norm = self._addr(layer.k_norm, norms)
            entry.attn_out_norm = self._addr(layer.attn_out_norm, norms)
            entry.ffn_out_norm = self._addr(layer.ffn_out_norm, norms)
            entry.cos_sin = self._addr(layer.cos_sin, torch.float32)
            entry.window = layer.window
            self._linear(entry, "qkv", layer.qkv)
            entry.o_bias = self._addr(layer.o_bias, self.dtype)
            self._linear(entry, "o", layer.o)
            if layer.experts is not None:
                entry.moe = self._moe(layer)
            else:
                self._linear(entry, "gate_up", layer.gate_up)
                self._linear(entry, "down", layer.down)
            entry.key_cache = self._addr(key_cache, self.cache_dtype)
            entry.value_cache = self._addr(value_cache, self.cache_dtype)
            entry.sinks = self._addr(
                None if layer_sinks is None else layer_sinks.data, torch.float32
            )
        return table

    def _moe(self, layer: Any) -> int:
        """The address of a cpud_moe struct for an expert layer cpud_moe_layer runs (kept
        alive with the tensors it points into)."""
        from cpud.native.moe_kernels import MoeLayer

        experts = layer.experts
        top_k = self.table.experts_per_tok
        moe = MoeLayer(
            *experts.stacks(), top_k, experts.recipe, *experts.biases(), layer.router.packed
        )
        self._keep.append(moe)
        return moe.address

    def _linear(self, entry: Any, name: str, layer: Any) -> None:
        """The layer's weight in `entry`: packed bf16 address, or its quantized parts."""
        if layer.quant is None:
            self.linear_bytes += layer.packed.data.nbytes
            setattr(entry, name, self._addr(layer.packed.data))
            if name == "qkv":
                entry.qkv_bias = self._addr(layer.packed.bias, torch.float32)
            return
        from cpud.native.quant import QTYPES

        q = getattr(entry, f"q_{name}")
        q.parts = len(layer.quant)
        for i, (_, weight) in enumerate(layer.quant):
            self.linear_bytes += weight.qs.nbytes + weight.sc.nbytes
            q.qtype[i] = QTYPES[weight.qtype][0]
            q.n[i] = weight.n
            q.qs[i] = self._addr(weight.qs)
            q.sc[i] = self._addr(weight.sc)
            q.bias[i] = self._addr(weight.bias, torch.float32)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Final-normed hidden states [T, H] of the step's tokens; writes their KV."""
        tokens = input_ids.shape[0]
        index = (
            positions,
            meta.slot_mapping,
            meta.query_start_loc,
            meta.seq_lens_tensor,
            meta.block_tables_i32,
        )
        for tensor, (name, dtype) in zip(index, _INDEX_DTYPES):
            if tensor.dtype != dtype or not tensor.is_contiguous():
                raise ValueError(f"fused decoder: {name} must be a contiguous {dtype} tensor")
        if positions.shape[0] != tokens or meta.slot_mapping.shape[0] != tokens:
            raise ValueError(
                f"fused decoder: {tokens} tokens but {positions.shape[0]} positions and "
                f"{meta.slot_mapping.shape[0]} slots"
            )
        x = self.table.embed(input_ids).contiguous()
        residual, qkv, attn, gate_up, act = self._buffers(tokens)
        residual.zero_()
        step = self._ffi.new("cpud_decoder_step *")
        step.T = tokens
        step.S = meta.seq_lens_tensor.shape[0]
        step.max_blocks = meta.block_tables_i32.shape[1] if meta.block_tables_i32.dim() == 2 else 0
        step.positions = positions.data_ptr()
        step.slots = meta.slot_mapping.data_ptr()
        step.query_start_loc = meta.query_start_loc.data_ptr()
        step.seq_lens = meta.seq_lens_tensor.data_ptr()
        step.block_tables = meta.block_tables_i32.data_ptr()
        step.x = x.data_ptr()
        step.residual = residual.data_ptr()
        step.qkv = qkv.data_ptr()
        step.attn = attn.data_ptr()
        step.gate_up = gate_up.data_ptr()
        step.act = act.data_ptr()
        self._run(step)
        hidden, _ = self.table.final_norm(x, residual)
        return hidden

    def _buffers(self, tokens: int) -> tuple[torch.Tensor, ...]:
        """The step's residual and scratch rows ([T, width] in the activations' dtype): kept
        from the step before when it had as many tokens and at most DECODE_BUFFER_TOKENS (a
        decode batch keeps its size from step to step), made anew otherwise. Nothing reads
        them after the step: the final norm's output feeds the LM head within it."""
        if self._kept is not None and self._kept[0].shape[0] == tokens:
            return self._kept
        widths = (self.hidden, self.qkv_dim, self.q_dim, 2 * self.intermediate, self.intermediate)
        made = tuple(torch.empty(tokens, w, dtype=self.dtype) for w in widths)
        self._kept = made if tokens <= DECODE_BUFFER_TOKENS else None
        return made

    def _run(self, step: Any) -> None:
        if self._shm is None:
            handle, timeout_ns, peer = self._ffi.NULL, 0, self._peer
        else:
            handle, timeout_ns, peer = self._shm.native_collective_args()
        layers = len(self.table.layers)
        rc = self._lib.cpud_decoder_layers(
            self._isa, self._dims, self._layers, layers, step, handle, timeout_ns, peer
        )
        self.linear_seconds += step.linear_ns / 1e9
        self.team_steps += step.team
        if step.allreduce_calls and hasattr(self.group, "seconds"):
            self.group.seconds += step.allreduce_ns / 1e9  # TimedGroup's all-reduce time
            self.group.calls += step.allreduce_calls
        if rc and step.failed_collective and self._shm is not None:
            self._shm.raise_collective_error(rc, "all_reduce")
        check_rc(rc, "fused decoder", "a position, slot or block table out of range?")
