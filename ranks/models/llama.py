"""One config-driven decoder for Llama, Mistral, Qwen2 and Qwen3.

GQA, RoPE (with scaling), RMSNorm, SwiGLU, optional qkv bias, optional per-head q/k norm,
optional tied embeddings, optional sliding window. Module names mirror Hugging Face's so
checkpoint names map by a few substitutions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from cpud.model.model_config import ModelConfig
from cpud.ranks.layers.attention import PagedAttention
from cpud.ranks.layers.base import Layer
from cpud.ranks.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from cpud.ranks.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from cpud.ranks.layers.norm import RMSNorm
from cpud.ranks.layers.rotary import RotaryEmbedding
from cpud.ranks.models.decoder_weights import DecoderLayerWeights, DecoderWeights
from cpud.ranks.ops import Ops
from cpud.ranks.paged_kv import AttentionMetadata
from cpud.ranks.parallel import TPGroup

KVCache = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(Layer):
    def __init__(
        self,
        cfg: ModelConfig,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        group: TPGroup,
        ops: Ops,
    ):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.qkv_bias,
            dtype,
            group,
        )
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, dtype, group
        )
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, dtype, ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, dtype, ops) if cfg.qk_norm else None
        self.heads = self.qkv_proj.num_heads_local
        self.kv_heads = self.qkv_proj.num_kv_heads_local
        self.head_dim = cfg.head_dim
        self.rotary = rotary
        self.attn = PagedAttention(
            self.heads, self.kv_heads, cfg.head_dim, cfg.head_dim**-0.5, ops, cfg.sliding_window
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(
            [self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1
        )
        q = q.view(tokens, self.heads, self.head_dim)
        k = k.view(tokens, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm.normalize(q)
            k = self.k_norm.normalize(k)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q.reshape(tokens, -1), k.reshape(tokens, -1), v, kv_cache, meta)
        return self.o_proj(out)


class LlamaMLP(Layer):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, group: TPGroup, ops: Ops):
        super().__init__()
        self.ops = ops
        size = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [size, size], False, dtype, group)
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, False, dtype, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(Layer):
    def __init__(
        self,
        cfg: ModelConfig,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        group: TPGroup,
        ops: Ops,
        mlp: Layer | None = None,
    ):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary, dtype, group, ops)
        self.mlp = LlamaMLP(cfg, dtype, group, ops) if mlp is None else mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype, ops)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, normed, kv_cache, meta)
        normed, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(normed), residual


class LlamaModel(Layer):
    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        dtype: torch.dtype,
        group: TPGroup,
        ops: Ops,
        mlp_for: Callable[[int], Layer | None] = lambda index: None,
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, group)
        rotary = RotaryEmbedding(
            cfg.rotary_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, ops
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, rotary, dtype, group, ops, mlp_for(i))
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype, ops)


class LlamaForCausalLM(Layer):
    # (param fragment, checkpoint fragment, shard id) for weights fused at load time
    stacked_params = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )
    ignored_suffixes = ("rotary_emb.inv_freq",)

    def __init__(
        self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype, group: TPGroup, ops: Ops
    ):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(
            cfg, max_positions, dtype, group, ops, lambda i: self.mlp_for(i, dtype, group, ops)
        )
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype, group, tied)
        attn = self.model.layers[0].self_attn
        self.kv_heads_local = attn.kv_heads
        self.head_dim = cfg.head_dim

    def decoder_weights(self) -> DecoderWeights:
        """The shape and weights the fused decoder runs (ranks/fused_decoder.py)."""
        first = self.model.layers[0]
        attn = first.self_attn
        return DecoderWeights(
            layers=tuple(self.layer_weights(layer) for layer in self.model.layers),
            heads=attn.heads,
            kv_heads=attn.kv_heads,
            head_dim=attn.head_dim,
            q_size=attn.qkv_proj.q_size,
            kv_size=attn.qkv_proj.kv_size,
            intermediate=self.cfg.intermediate_size // attn.qkv_proj.group.size,
            cos_sin=attn.rotary.cos_sin,
            window=attn.attn.sliding_window or 0,
            eps=first.input_layernorm.eps,
            scale=attn.attn.scale,
            embed=self.model.embed_tokens,
            final_norm=self.model.norm,
        )

    @staticmethod
    def layer_weights(layer: LlamaDecoderLayer) -> DecoderLayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        return DecoderLayerWeights(
            input_norm=layer.input_layernorm.weight,
            post_norm=layer.post_attention_layernorm.weight,
            q_norm=None if attn.q_norm is None else attn.q_norm.weight,
            k_norm=None if attn.k_norm is None else attn.k_norm.weight,
            qkv=attn.qkv_proj,
            o=attn.o_proj,
            o_bias=attn.o_proj.bias,
            gate_up=getattr(mlp, "gate_up_proj", None),
            down=getattr(mlp, "down_proj", None),
        )

    def mlp_for(self, index: int, dtype: torch.dtype, group: TPGroup, ops: Ops) -> Layer | None:
        """Layer `index`'s feed-forward block; None: the dense SwiGLU MLP."""
        return None

    @staticmethod
    def checkpoint_name(name: str) -> str:
        return name

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)
