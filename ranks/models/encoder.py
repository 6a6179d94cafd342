"""A BERT-style encoder (ranks/models/families/bert.py): token + absolute position + token type
embeddings under a LayerNorm, then post-norm layers of bidirectional attention and an exact-GELU
MLP, every projection with a bias. It embeds only: each step's sequences attend within
themselves (no KV cache) and the runner pools the final hidden states. Tensor parallel as the
decoder: q/k/v and the MLP's up projection split by rows, the output projections by columns
with one all-reduce each; embeddings and norms replicated (the word table split by vocab)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cpud.model.model_config import ModelConfig
from cpud.ranks.layers.base import Layer
from cpud.ranks.layers.embedding import VocabParallelEmbedding
from cpud.ranks.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    load_whole,
    new_param,
)
from cpud.ranks.layers.norm import LayerNorm
from cpud.ranks.ops import Ops
from cpud.ranks.paged_kv import AttentionMetadata
from cpud.ranks.parallel import TPGroup

KVCache = tuple[torch.Tensor, torch.Tensor]

# Hugging Face BertModel names -> the encoder's; the first that matches applies, in order
_RENAMES = (
    ("embeddings.word_embeddings.", "model.embed_tokens."),
    ("embeddings.position_embeddings.", "model.embed_positions."),
    ("embeddings.token_type_embeddings.", "model.embed_token_types."),
    ("embeddings.LayerNorm.", "model.embed_norm."),
    ("encoder.layer.", "model.layers."),
)
_LAYER_RENAMES = (
    (".attention.self.query.", ".self_attn.q_proj."),
    (".attention.self.key.", ".self_attn.k_proj."),
    (".attention.self.value.", ".self_attn.v_proj."),
    (".attention.output.dense.", ".self_attn.o_proj."),
    (".attention.output.LayerNorm.", ".attention_layernorm."),
    (".intermediate.dense.", ".mlp.up_proj."),
    (".output.dense.", ".mlp.down_proj."),
    (".output.LayerNorm.", ".output_layernorm."),
)


def _runs(lens: list[int]) -> list[tuple[int, int, int]]:
    """(first row, sequences, length) of each run of consecutive sequences of one length."""
    runs: list[tuple[int, int, int]] = []
    row = 0
    for n in lens:
        if runs and runs[-1][2] == n:
            first, count, _ = runs[-1]
            runs[-1] = (first, count + 1, n)
        else:
            runs.append((row, 1, n))
        row += n
    return runs


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """Bidirectional attention of each sequence over its own tokens; q, k, v: [T, heads, d]
    with the sequences' tokens one after another. A run of sequences of one length is one
    batch, read and written in place."""
    out = torch.empty_like(q)
    for first, count, n in _runs(lens):
        rows = slice(first, first + count * n)
        # [B * n, heads, d] -> [B, heads, n, d]
        qb, kb, vb = (x[rows].unflatten(0, (count, n)).transpose(1, 2) for x in (q, k, v))
        attended = F.scaled_dot_product_attention(qb, kb, vb)  # [B, heads, n, d]
        out[rows].unflatten(0, (count, n)).copy_(attended.transpose(1, 2))
    return out


class EncoderAttention(Layer):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, group: TPGroup):
        super().__init__()
        h = cfg.hidden_size
        self.qkv_proj = QKVParallelLinear(
            h, cfg.head_dim, cfg.num_heads, cfg.num_heads, True, dtype, group
        )
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, h, True, dtype, group)
        self.heads = self.qkv_proj.num_heads_local
        self.head_dim = cfg.head_dim

    def forward(self, hidden: torch.Tensor, lens: list[int]) -> torch.Tensor:
        tokens = hidden.shape[0]
        size = self.qkv_proj.q_size
        q, k, v = (
            x.reshape(tokens, self.heads, self.head_dim)
            for x in self.qkv_proj(hidden).split([size, size, size], dim=-1)
        )
        return self.o_proj(_attention(q, k, v, lens).reshape(tokens, size))


class EncoderMLP(Layer):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, group: TPGroup):
        super().__init__()
        size = cfg.intermediate_size
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, [size], True, dtype, group)
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, True, dtype, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class EncoderLayer(Layer):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, group: TPGroup):
        super().__init__()
        self.self_attn = EncoderAttention(cfg, dtype, group)
        self.attention_layernorm = LayerNorm(cfg.hidden_size, cfg.norm_eps, dtype)
        self.mlp = EncoderMLP(cfg, dtype, group)
        self.output_layernorm = LayerNorm(cfg.hidden_size, cfg.norm_eps, dtype)

    def forward(self, hidden: torch.Tensor, lens: list[int]) -> torch.Tensor:
        hidden = self.attention_layernorm(self.self_attn(hidden, lens) + hidden)
        return self.output_layernorm(self.mlp(hidden) + hidden)


class EncoderModel(Layer):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, group: TPGroup):
        super().__init__()
        h = cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, h, dtype, group)
        self.embed_positions = nn.Module()
        self.embed_positions.weight = new_param((cfg.max_position_embeddings, h), dtype, load_whole)
        self.embed_token_types = nn.Module()
        self.embed_token_types.weight = new_param((cfg.type_vocab_size, h), dtype, load_whole)
        self.embed_norm = LayerNorm(h, cfg.norm_eps, dtype)
        self.layers = nn.ModuleList(EncoderLayer(cfg, dtype, group) for _ in range(cfg.num_layers))


class EncoderForEmbedding(Layer):
    stacked_params = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
    )
    # position_ids: a buffer some checkpoints save; pooler: BertModel's tanh head on [CLS],
    # which sentence-transformers does not use
    ignored_suffixes = ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")
    uses_kv_cache = False

    def __init__(
        self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype, group: TPGroup, ops: Ops
    ):
        super().__init__()
        self.cfg = cfg
        self.model = EncoderModel(cfg, dtype, group)
        self.kv_heads_local = self.model.layers[0].self_attn.heads
        self.head_dim = cfg.head_dim

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """The encoder's name for a Hugging Face BERT tensor (BertModel's, with or without the
        `bert.` prefix of its task heads; LayerNorm gamma/beta as weight/bias)."""
        name = name.removeprefix("bert.")
        if name.endswith(".gamma"):
            name = name.removesuffix(".gamma") + ".weight"
        elif name.endswith(".beta"):
            name = name.removesuffix(".beta") + ".bias"
        for old, new in _RENAMES:
            if name.startswith(old):
                name = new + name.removeprefix(old)
                break
        if name.startswith("model.layers."):
            for old, new in _LAYER_RENAMES:
                if old in name:
                    return name.replace(old, new, 1)
        return name

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states [T, H] of the step's sequences, each encoded on its own tokens
        (token type 0)."""
        model = self.model
        if len(positions) and int(positions.max()) >= model.embed_positions.weight.shape[0]:
            raise ValueError(
                f"position {int(positions.max())} is past the model's "
                f"{model.embed_positions.weight.shape[0]} position embeddings"
            )
        hidden = model.embed_tokens(input_ids) + model.embed_token_types.weight[0]
        hidden = model.embed_norm(hidden + model.embed_positions.weight[positions])
        lens = list(meta.query_lens)
        for layer in model.layers:
            hidden = layer(hidden, lens)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        raise ValueError(f"{self.cfg.architecture} is an embedding model: it has no logits")
