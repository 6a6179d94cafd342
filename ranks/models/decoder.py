"""The decoder every recipe family runs op by op (ranks/models/registry.py): GQA, RoPE
tables per layer (or none), RMSNorm in either rounding, sandwich norms, gated SiLU or GELU-tanh,
optional biases and q/k norm, multipliers and logit soft-capping, all as the config's
DecoderRecipe says (cpud.model.recipe). The fused native decoder (ranks/fused_decoder.py) runs
the same recipe with the same kernels. Module names mirror Hugging Face's Llama so checkpoint
names map by a few substitutions (a family adds its own renames)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from cpud.model.model_config import ModelConfig
from cpud.ranks.layers.attention import PagedAttention
from cpud.ranks.layers.base import Layer
from cpud.ranks.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from cpud.ranks.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    copy_checked,
    new_param,
)
from cpud.ranks.layers.norm import RMSNorm
from cpud.ranks.layers.rotary import RotaryEmbedding
from cpud.ranks.models import registry
from cpud.ranks.models.decoder_weights import DecoderLayerWeights, DecoderWeights
from cpud.ranks.ops import Ops
from cpud.ranks.paged_kv import AttentionMetadata
from cpud.ranks.parallel import TPGroup

KVCache = tuple[torch.Tensor, torch.Tensor]


def make_norm(cfg: ModelConfig, dim: int, dtype: torch.dtype, ops: Ops) -> RMSNorm:
    recipe = cfg.recipe
    fp32 = recipe.norm == "rms_fp32_weight"
    return RMSNorm(dim, cfg.norm_eps, dtype, ops, fp32, recipe.norm_weight_offset)


class Attention(Layer):
    def __init__(
        self,
        cfg: ModelConfig,
        rotary: RotaryEmbedding | None,
        dtype: torch.dtype,
        group: TPGroup,
        ops: Ops,
        window: int = 0,
    ):
        super().__init__()
        recipe = cfg.recipe
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_heads,
            cfg.num_kv_heads,
            recipe.qkv_bias,
            dtype,
            group,
        )
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, recipe.o_bias, dtype, group
        )
        qk_norm = recipe.qk_norm
        self.q_norm = make_norm(cfg, cfg.head_dim, dtype, ops) if qk_norm else None
        self.k_norm = make_norm(cfg, cfg.head_dim, dtype, ops) if qk_norm else None
        self.heads = self.qkv_proj.num_heads_local
        self.kv_heads = self.qkv_proj.num_kv_heads_local
        self.head_dim = cfg.head_dim
        self.rotary = rotary
        self.attn = PagedAttention(
            self.heads, self.kv_heads, cfg.head_dim, recipe.attention_scale, ops, window or None
        )
        # fp32 whatever the model's dtype: one logit per head, this rank's heads
        self.sinks = (
            new_param((self.heads,), torch.float32, self.load_sinks)
            if recipe.attention_sinks
            else None
        )

    def load_sinks(self, param: nn.Parameter, source, shard_id=None) -> None:
        first = self.qkv_proj.group.rank * self.heads
        rows = source[first : first + self.heads]
        copy_checked(param.data, rows.to(torch.float32), "self_attn.sinks")

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
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        out = self.attn(q.reshape(tokens, -1), k.reshape(tokens, -1), v, kv_cache, meta, self.sinks)
        return self.o_proj(out)


class GatedMLP(Layer):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, group: TPGroup, ops: Ops):
        super().__init__()
        self.ops = ops
        size = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [size, size], False, dtype, group)
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, False, dtype, group)
        gelu = cfg.recipe is not None and cfg.recipe.activation == "gelu_tanh"
        self.act_and_mul = ops.gelu_tanh_and_mul if gelu else ops.silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class DecoderLayer(Layer):
    def __init__(
        self,
        cfg: ModelConfig,
        rotary: RotaryEmbedding | None,
        dtype: torch.dtype,
        group: TPGroup,
        ops: Ops,
        mlp: Layer | None = None,
        window: int = 0,
    ):
        super().__init__()
        recipe = cfg.recipe
        self.self_attn = Attention(cfg, rotary, dtype, group, ops, window)
        self.mlp = GatedMLP(cfg, dtype, group, ops) if mlp is None else mlp
        self.input_layernorm = make_norm(cfg, cfg.hidden_size, dtype, ops)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size, dtype, ops)
        sandwich = recipe.sandwich_norms
        self.attn_out_norm = make_norm(cfg, cfg.hidden_size, dtype, ops) if sandwich else None
        self.ffn_out_norm = make_norm(cfg, cfg.hidden_size, dtype, ops) if sandwich else None
        self.residual_multiplier = recipe.residual_multiplier

    def block_output(self, x: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        """An attention or feed-forward output as it joins the residual stream."""
        if norm is not None:
            x = norm.normalize(x)
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        return x

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, residual = self.input_layernorm(hidden, residual)
        hidden = self.block_output(
            self.self_attn(positions, normed, kv_cache, meta), self.attn_out_norm
        )
        normed, residual = self.post_attention_layernorm(hidden, residual)
        return self.block_output(self.mlp(normed), self.ffn_out_norm), residual


class DecoderModel(Layer):
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
        recipe = cfg.recipe
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, group)
        self.rotaries = nn.ModuleList(
            RotaryEmbedding(recipe.rotary_dim, max_positions, rope.theta, rope.scaling, ops)
            for rope in recipe.ropes
        )
        self.layers = nn.ModuleList(
            DecoderLayer(
                cfg,
                None if layer.rope < 0 else self.rotaries[layer.rope],
                dtype,
                group,
                ops,
                mlp_for(i),
                layer.window,
            )
            for i, layer in enumerate(recipe.layers)
        )
        self.norm = make_norm(cfg, cfg.hidden_size, dtype, ops)


class DecoderForCausalLM(Layer):
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
        self.model = DecoderModel(
            cfg, max_positions, dtype, group, ops, lambda i: self.mlp_for(i, dtype, group, ops)
        )
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype, group, tied)
        attn = self.model.layers[0].self_attn
        self.kv_heads_local = attn.kv_heads
        self.head_dim = cfg.head_dim
        family = registry.by_name(cfg.family)
        self.renames = family.checkpoint_renames
        self.fused = family.fused_checkpoint
        self.views = family.checkpoint_views

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings, times the recipe's embedding multiplier."""
        hidden = self.model.embed_tokens(input_ids)
        recipe = self.cfg.recipe
        if recipe.embedding_multiplier == 1.0:
            return hidden
        if recipe.embedding_multiplier_in_dtype:
            return hidden * torch.tensor(recipe.embedding_multiplier, dtype=hidden.dtype)
        return hidden * recipe.embedding_multiplier

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
            eps=first.input_layernorm.eps,
            scale=attn.attn.scale,
            embed=self.embed,
            final_norm=self.model.norm,
            rotary_dim=self.cfg.recipe.rotary_dim,
            max_positions=self.model.rotaries[0].cos_sin.shape[0],
            gelu=self.cfg.recipe.activation == "gelu_tanh",
            residual_scale=self.cfg.recipe.residual_multiplier,
        )

    @staticmethod
    def layer_weights(layer: DecoderLayer) -> DecoderLayerWeights:
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
            cos_sin=None if attn.rotary is None else attn.rotary.cos_sin,
            window=attn.attn.sliding_window or 0,
            attn_out_norm=None if layer.attn_out_norm is None else layer.attn_out_norm.weight,
            ffn_out_norm=None if layer.ffn_out_norm is None else layer.ffn_out_norm.weight,
        )

    def mlp_for(self, index: int, dtype: torch.dtype, group: TPGroup, ops: Ops) -> Layer | None:
        """Layer `index`'s feed-forward block; None: the dense SwiGLU MLP."""
        return None

    def checkpoint_name(self, name: str) -> str:
        """cpud's name for a checkpoint tensor: the family's first matching rename applied. A
        base model's names (Qwen3-Embedding saves Qwen3Model's: layers.0...) get `model.`."""
        if not name.startswith(("model.", "lm_head.")):
            name = "model." + name
        for old, new in self.renames:
            if f".{old}." in name:
                return name.replace(f".{old}.", f".{new}.")
        return name

    def fused_parts(self, name: str) -> list[tuple] | None:
        """(target name, part id, first row, rows) of each part of a checkpoint tensor that
        stacks several of cpud's parts by rows (Phi-3's qkv_proj), or (target name, part id,
        view) of each piece the family reads through a view (gpt-oss's expert stacks), else
        None."""
        if self.views is not None:
            pieces = self.views(name, self.cfg)
            if pieces is not None:
                return pieces
        for ckpt, ours, part_ids in self.fused:
            if f".{ckpt}." not in name:
                continue
            target = name.replace(f".{ckpt}.", f".{ours}.")
            layer = self.get_submodule(target.rsplit(".", 1)[0])
            sizes = layer.part_rows(part_ids)
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            return [(target, p, r, n) for p, r, n in zip(part_ids, starts, sizes)]
        return None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.embed(input_ids)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        recipe = self.cfg.recipe
        if logits is None:
            return None
        if recipe.logit_multiplier != 1.0:
            logits = logits * recipe.logit_multiplier
        if recipe.final_logit_softcap:
            cap = recipe.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
