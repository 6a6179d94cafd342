"""cpud_decoder_layers driven straight through cffi with a non-Llama recipe (f32 norm weights,
gated GELU-tanh, gpt-j rotary, a NoPE layer, per-layer windows, output norms, a residual scale):
the same bits as the per-op kernels chained in the recipe's order, and bad recipe fields refused
with CPUD_EARG."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from cpud.native import _loader, pack_weight
from cpud.ranks.layers.rotary import cos_sin_table

F32, BF16, EARG = 0, 1, -2
H, NH, NKV, HD, INTER, ROT = 64, 4, 2, 16, 96, 16
QD, KVD = NH * HD, NKV * HD
BS, BLOCKS, MAX_POS, EPS, SCALE = 4, 8, 32, 1e-6, 0.3
QSL, SEQ_LENS, TABLES = [0, 5, 8], [5, 3], [[0, 1], [2, 3]]


@dataclass
class Layer:
    tensors: dict[str, torch.Tensor]
    cos_sin: torch.Tensor | None
    window: int
    caches: tuple[torch.Tensor, torch.Tensor] = field(init=False)

    def __post_init__(self) -> None:
        self.caches = tuple(torch.zeros(BLOCKS, NKV, BS, HD, dtype=torch.bfloat16) for _ in "kv")


def make_layer(cos_sin: torch.Tensor | None, window: int) -> Layer:
    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.3 * torch.randn(n)  # f32, Gemma's folded 1 + w

    def lin(n: int, k: int) -> Any:
        return pack_weight(torch.randn(n, k) / k**0.5, huge_pages=False)

    tensors = {
        "input_norm": norm(H), "post_norm": norm(H), "q_norm": norm(HD), "k_norm": norm(HD),
        "attn_out_norm": norm(H), "ffn_out_norm": norm(H),
        "qkv": lin(QD + 2 * KVD, H), "o": lin(H, QD), "gate_up": lin(2 * INTER, H),
        "down": lin(H, INTER),
    }  # fmt: skip
    return Layer(tensors, cos_sin, window)


def step_tensors() -> dict[str, torch.Tensor]:
    positions = [p for n in SEQ_LENS for p in range(n)]
    slots = [TABLES[s][p // BS] * BS + p % BS for s, n in enumerate(SEQ_LENS) for p in range(n)]
    return {
        "positions": torch.tensor(positions, dtype=torch.int64),
        "slots": torch.tensor(slots, dtype=torch.int64),
        "qsl": torch.tensor(QSL, dtype=torch.int32),
        "seq_lens": torch.tensor(SEQ_LENS, dtype=torch.int32),
        "tables": torch.tensor(TABLES, dtype=torch.int32),
    }


def per_op(kern: Any, layers: list[Layer], x: torch.Tensor, index: dict) -> tuple:
    """The recipe op by op with the Kernels wrappers: (x, residual) after the last layer."""
    x, res = x.clone(), torch.zeros_like(x)
    for layer in layers:
        w = layer.tensors
        kern.fused_add_rms_norm(x, res, w["input_norm"], EPS)
        qkv = kern.gemm_packed(x, w["qkv"])
        q = qkv[:, :QD].view(-1, NH, HD)
        k = qkv[:, QD : QD + KVD].view(-1, NKV, HD)
        v = qkv[:, QD + KVD :].view(-1, NKV, HD)
        kern.rms_norm(q, w["q_norm"], EPS)
        kern.rms_norm(k, w["k_norm"], EPS)
        if layer.cos_sin is not None:
            kern.rotary_embedding(index["positions"], q, k, layer.cos_sin, is_neox=False)
        kern.write_kv_cache(k, v, *layer.caches, index["slots"])
        attn = kern.paged_attention(
            q, *layer.caches, index["qsl"], index["seq_lens"], index["tables"], 0.25,
            layer.window,
        )  # fmt: skip
        x = kern.gemm_packed(attn.view(-1, QD), w["o"])
        x = kern.rms_norm(x, w["attn_out_norm"], EPS) * SCALE
        kern.fused_add_rms_norm(x, res, w["post_norm"], EPS)
        act = kern.gelu_tanh_and_mul(kern.gemm_packed(x, w["gate_up"]))
        x = kern.gemm_packed(act, w["down"])
        x = kern.rms_norm(x, w["ffn_out_norm"], EPS) * SCALE
    return x, res


class Fused:
    """The cffi structs of one cpud_decoder_layers call over `layers` (addresses kept alive)."""

    def __init__(self, layers: list[Layer], index: dict, tokens: int) -> None:
        ffi = _loader.ffi
        self.keep: list[Any] = []
        d = ffi.new("cpud_decoder_dims *")
        d.dtype, d.hidden, d.heads, d.kv_heads, d.head_dim = BF16, H, NH, NKV, HD
        d.rot_dim, d.intermediate, d.max_pos = ROT, INTER, MAX_POS
        d.num_blocks, d.block_size, d.eps, d.scale = BLOCKS, BS, EPS, 0.25
        d.norm_wdt, d.activation, d.rotary_neox, d.residual_scale = F32, 1, 0, SCALE
        self.dims = d
        self.layers = ffi.new("cpud_decoder_layer[]", len(layers))
        for entry, layer in zip(self.layers, layers):
            for name, t in layer.tensors.items():
                setattr(entry, name, self.addr(t if isinstance(t, torch.Tensor) else t.data))
            entry.cos_sin = 0 if layer.cos_sin is None else self.addr(layer.cos_sin)
            entry.window = layer.window
            entry.key_cache, entry.value_cache = (self.addr(c) for c in layer.caches)
        s = ffi.new("cpud_decoder_step *")
        s.T, s.S, s.max_blocks = tokens, len(SEQ_LENS), len(TABLES[0])
        s.positions, s.slots = self.addr(index["positions"]), self.addr(index["slots"])
        s.query_start_loc, s.seq_lens = self.addr(index["qsl"]), self.addr(index["seq_lens"])
        s.block_tables = self.addr(index["tables"])
        self.x = torch.empty(tokens, H, dtype=torch.bfloat16)
        self.res = torch.zeros_like(self.x)
        s.x, s.residual = self.addr(self.x), self.addr(self.res)
        s.qkv = self.addr(torch.empty(tokens, QD + 2 * KVD, dtype=torch.bfloat16))
        s.attn = self.addr(torch.empty(tokens, QD, dtype=torch.bfloat16))
        s.gate_up = self.addr(torch.empty(tokens, 2 * INTER, dtype=torch.bfloat16))
        s.act = self.addr(torch.empty(tokens, INTER, dtype=torch.bfloat16))
        self.step = s

    def addr(self, t: torch.Tensor) -> int:
        self.keep.append(t)
        return t.data_ptr()

    def run(self, isa: str) -> int:
        peer = _loader.ffi.new("int *")
        return _loader.lib.cpud_decoder_layers(
            _loader.ISAS.index(isa), self.dims, self.layers, len(self.layers), self.step,
            _loader.ffi.NULL, 0, peer,
        )  # fmt: skip


def recipe_stack() -> tuple[list[Layer], dict]:
    table = cos_sin_table(ROT, MAX_POS, 10000.0)
    return [make_layer(table, 0), make_layer(None, 2)], step_tensors()


def test_fused_recipe_equals_per_op_kernels(kern):
    layers, index = recipe_stack()
    tokens = QSL[-1]
    embed = torch.randn(tokens, H).to(torch.bfloat16)
    want_x, want_res = per_op(kern, layers, embed, index)
    want_caches = [c.clone() for layer in layers for c in layer.caches]
    for layer in layers:
        for c in layer.caches:
            c.zero_()
    fused = Fused(layers, index, tokens)
    fused.x.copy_(embed)
    assert fused.run(kern.isa) == 0
    assert torch.equal(fused.x, want_x)
    assert torch.equal(fused.res, want_res)
    caches = [c for layer in layers for c in layer.caches]
    assert all(torch.equal(c, w) for c, w in zip(caches, want_caches))


@pytest.mark.parametrize(
    "where, name, value",
    [
        ("dims", "activation", 7),
        ("dims", "norm_wdt", 9),
        ("dims", "rotary_neox", 2),
        ("dims", "residual_scale", 0.0),
        ("dims", "residual_scale", float("nan")),
        ("dims", "residual_scale", -1.0),
        ("layer", "window", -1),
    ],
)
def test_bad_recipe_fields_are_refused(kern, where, name, value):
    layers, index = recipe_stack()
    fused = Fused(layers, index, QSL[-1])
    assert fused.run(kern.isa) == 0
    setattr(fused.dims if where == "dims" else fused.layers[1], name, value)
    assert fused.run(kern.isa) == EARG


def test_bf16_norm_weight_on_f32_rows_is_refused(kern):
    layers, index = recipe_stack()
    fused = Fused(layers, index, QSL[-1])
    fused.dims.dtype = F32  # rows f32 (the buffers are bigger than needed), norms bf16
    fused.dims.norm_wdt = BF16
    assert fused.run(kern.isa) == EARG


def test_block_tables_checked_for_the_widest_window(kern):
    # decode of sequence 0 at position 8 reads blocks 1..2 under window 2, blocks 0..2 when
    # global: a freed block 0 is fine only while no layer is global
    layers, index = recipe_stack()
    for layer in layers:
        layer.window = 2
    index.update(
        positions=torch.tensor([8, 2], dtype=torch.int64),
        slots=torch.tensor([16, 14], dtype=torch.int64),
        qsl=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=torch.tensor([9, 3], dtype=torch.int32),
        tables=torch.tensor([[-1, 2, 4], [3, 5, 6]], dtype=torch.int32),
    )
    fused = Fused(layers, index, 2)
    fused.step.max_blocks = 3
    assert fused.run(kern.isa) == 0
    fused.layers[1].window = 0
    assert fused.run(kern.isa) == EARG
