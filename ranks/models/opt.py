"""OPT: learned positions (offset 2), LayerNorm, ReLU MLP, biases everywhere, tied head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cpud.model.model_config import ModelConfig
from cpud.ranks.layers.attention import PagedAttention
from cpud.ranks.layers.base import Layer
from cpud.ranks.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from cpud.ranks.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    load_whole,
    new_param,
)
from cpud.ranks.layers.norm import LayerNorm
from cpud.ranks.ops import Ops
from cpud.ranks.paged_kv import AttentionMetadata
from cpud.ranks.parallel import TPGroup

KVCache = tuple[torch.Tensor, torch.Tensor]
POSITION_OFFSET = 2


class OPTAttention(Layer):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, group: TPGroup, ops: Ops):
        super().__init__()
        bias = cfg.enable_bias
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_heads, bias, dtype, group
        )
        self.out_proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, bias, dtype, group)
        heads = self.qkv_proj.num_heads_local
        self.attn = PagedAttention(heads, heads, cfg.head_dim, cfg.head_dim**-0.5, ops)

    def forward(
        self, hidden: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        size = self.qkv_proj.q_size
        q, k, v = self.qkv_proj(hidden).split([size, size, size], dim=-1)
        return self.out_proj(self.attn(q, k, v, kv_cache, meta))


class OPTDecoderLayer(Layer):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, group: TPGroup, ops: Ops):
        super().__init__()
        bias = cfg.enable_bias
        self.pre_norm = cfg.do_layer_norm_before
        self.act = F.relu if cfg.hidden_act == "relu" else F.gelu
        self.self_attn = OPTAttention(cfg, dtype, group, ops)
        self.self_attn_layer_norm = LayerNorm(cfg.hidden_size, cfg.norm_eps, dtype)
        self.fc1 = ColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size], bias, dtype, group
        )
        self.fc2 = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias, dtype, group)
        self.final_layer_norm = LayerNorm(cfg.hidden_size, cfg.norm_eps, dtype)

    def forward(
        self, hidden: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        residual = hidden
        if self.pre_norm:
            hidden = self.self_attn_layer_norm(hidden)
        hidden = residual + self.self_attn(hidden, kv_cache, meta)
        if not self.pre_norm:
            hidden = self.self_attn_layer_norm(hidden)
        residual = hidden
        if self.pre_norm:
            hidden = self.final_layer_norm(hidden)
        hidden = residual + self.fc2(self.act(self.fc1(hidden)))
        if not self.pre_norm:
            hidden = self.final_layer_norm(hidden)
        return hidden


class OPTDecoder(Layer):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, group: TPGroup, ops: Ops):
        super().__init__()
        proj_dim = cfg.word_embed_proj_dim or cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, proj_dim, dtype, group)
        self.embed_positions = nn.Module()
        self.embed_positions.weight = new_param(
            (cfg.max_position_embeddings + POSITION_OFFSET, cfg.hidden_size), dtype, load_whole
        )
        projected = proj_dim != cfg.hidden_size
        self.project_in = (
            ReplicatedLinear(proj_dim, cfg.hidden_size, False, dtype) if projected else None
        )
        self.project_out = (
            ReplicatedLinear(cfg.hidden_size, proj_dim, False, dtype) if projected else None
        )
        self.final_layer_norm = (
            LayerNorm(cfg.hidden_size, cfg.norm_eps, dtype) if cfg.do_layer_norm_before else None
        )
        self.layers = nn.ModuleList(
            OPTDecoderLayer(cfg, dtype, group, ops) for _ in range(cfg.num_layers)
        )


class OPTForCausalLM(Layer):
    stacked_params = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
    )
    ignored_suffixes = ()

    def __init__(
        self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype, group: TPGroup, ops: Ops
    ):
        super().__init__()
        self.cfg = cfg
        self.model = nn.Module()
        self.model.decoder = OPTDecoder(cfg, dtype, group, ops)
        decoder = self.model.decoder
        dim = cfg.word_embed_proj_dim or cfg.hidden_size
        tied = decoder.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(cfg.vocab_size, dim, dtype, group, tied)
        self.kv_heads_local = decoder.layers[0].self_attn.qkv_proj.num_heads_local
        self.head_dim = cfg.head_dim

    @staticmethod
    def checkpoint_name(name: str) -> str:
        return "model." + name if name.startswith("decoder.") else name

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        decoder = self.model.decoder
        hidden = decoder.embed_tokens(input_ids)
        if decoder.project_in is not None:
            hidden = decoder.project_in(hidden)
        hidden = hidden + decoder.embed_positions.weight[positions + POSITION_OFFSET]
        for layer, kv_cache in zip(decoder.layers, kv_caches):
            hidden = layer(hidden, kv_cache, meta)
        if decoder.final_layer_norm is not None:
            hidden = decoder.final_layer_norm(hidden)
        if decoder.project_out is not None:
            hidden = decoder.project_out(hidden)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)
