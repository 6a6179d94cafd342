"""perf/moe_step_bytes.py, the byte count perf/bench_moe.py sets against the read probe: a
decode step of a tiny Qwen3-MoE Q8_0 file (two expert layers around a dense one) reads, by
phase, exactly the packed sizes of the tensors it should: the file's Q8_0 blocks (whole
16-row groups, so packed = file bytes), only the routed experts' share of each stack, the
router packed bf16 in 32-row panels, norms in bf16, one embedding row per token, each
sequence's KV rows and the logits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from test_gguf_quantized import runner
from test_moe_gguf import write_moe_gguf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "perf"))

from moe_step_bytes import step_bytes  # noqa: E402

BF16, F32 = 2, 4


@pytest.fixture(scope="module")
def q8_moe(model_factory, tmp_path_factory):
    path = tmp_path_factory.mktemp("step-bytes") / "model.gguf"
    write_moe_gguf(model_factory("qwen3_moe"), path, T.Q8_0, T.Q8_0, keep_values=False)
    return path


def expected_bytes(path: Path, cfg, routed: list[int], contexts: list[int]) -> dict[str, int]:
    """The phases' bytes from the file's tensors, by the rules in the module doc."""
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    layers = 0
    for i, experts in enumerate(routed):
        for name, t in tensors.items():
            if not name.startswith(f"blk.{i}."):
                continue
            if name.endswith("_exps.weight"):
                layers += int(t.n_bytes) // cfg.num_experts * experts
            elif name.endswith("ffn_gate_inp.weight"):  # [E, H], bf16 panels of 32 rows
                layers += -(-cfg.num_experts // 32) * 32 * cfg.hidden_size * BF16
            elif t.tensor_type == T.F32:  # norms
                layers += int(t.n_elements) * BF16
            else:
                assert t.tensor_type == T.Q8_0 and int(t.shape[1]) % 16 == 0, name
                layers += int(t.n_bytes)
        layers += 2 * cfg.num_kv_heads * cfg.head_dim * BF16 * sum(contexts)
    embed = tensors["token_embd.weight"]
    return {
        "inputs": 0,
        "embed": len(contexts) * int(embed.n_bytes) // cfg.vocab_size,
        "layers": layers,
        "final_norm": cfg.hidden_size * BF16,
        "lm_head": int(tensors["output.weight"].n_bytes),
        "sample": len(contexts) * cfg.vocab_size * F32,
    }


def test_decode_step_bytes_are_the_packed_tensors_it_reads(q8_moe):
    run = runner(q8_moe, torch.bfloat16)
    cfg = run.model.cfg
    assert [cfg.moe_layer(i) for i in range(cfg.num_layers)] == [True, False, True]
    routed, contexts = [3, 0, 5], [5, 9]
    kv_token = 2 * cfg.num_kv_heads * cfg.head_dim * BF16
    got = step_bytes(run.model, routed, contexts, kv_token)
    assert got == expected_bytes(q8_moe, cfg, routed, contexts)
    fewer = step_bytes(run.model, [1, 0, 5], contexts, kv_token)
    stacks = [t for t in GGUFReader(str(q8_moe)).tensors if t.name.startswith("blk.0.ffn_")]
    one_expert = sum(int(t.n_bytes) for t in stacks if "_exps" in t.name) // cfg.num_experts
    assert got["layers"] - fewer["layers"] == 2 * one_expert


def panels(rows: int, columns: int) -> int:
    """A [rows, columns] weight packed bf16: rows padded to the 32-row panel."""
    return -(-rows // 32) * 32 * columns * BF16


def gpt_oss_expected(path: Path, cfg, routed: list[int], contexts: list[int]) -> int:
    """The layers' bytes of the gpt-oss file (MXFP4 experts, F32 elsewhere) held bf16: F32
    matrices as bf16 panels (q, k and v as one), column-parallel biases fp32 inside their
    packed weight, o's and the experts' biases bf16, norms and sinks fp32, the routed experts' MXFP4
    blocks (packed = file bytes), and on the sliding layers only the window's KV rows."""
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    h, e = cfg.hidden_size, cfg.num_experts
    total = 0
    for i, experts in enumerate(routed):
        t = {
            n.removeprefix(f"blk.{i}."): v for n, v in tensors.items() if n.startswith(f"blk.{i}.")
        }
        qkv_rows = sum(int(t[f"attn_{p}.weight"].shape[1]) for p in "qkv")
        total += panels(qkv_rows, h) + qkv_rows * F32
        total += panels(h, int(t["attn_output.weight"].shape[0])) + h * BF16
        total += panels(e, h) + e * F32 + cfg.num_heads * F32  # router, its bias; sinks
        total += 2 * h * F32  # attn_norm, post_attention_norm: gpt-oss keeps them fp32
        stacks = sum(int(t[f"ffn_{p}_exps.weight"].n_bytes) for p in ("gate", "up", "down"))
        biases = sum(int(t[f"ffn_{p}_exps.bias"].n_elements) for p in ("gate", "up", "down"))
        total += experts * (stacks + biases * BF16) // e
        window = cfg.sliding_window if i % 2 == 0 else 0
        attended = sum(min(c, window) if window else c for c in contexts)
        total += 2 * cfg.num_kv_heads * cfg.head_dim * BF16 * attended
    return total


def test_gpt_oss_step_bytes_count_biases_sinks_and_windows(model_factory, tmp_path):
    from test_gpt_oss_gguf import write_gpt_oss_gguf

    path = tmp_path / "gpt-oss.gguf"
    write_gpt_oss_gguf(model_factory("gpt_oss"), path, T.MXFP4, T.F32)
    run = runner(path, torch.bfloat16)
    cfg = run.model.cfg
    routed, contexts = [2, 3], [5, 12]  # 12 tokens: past the sliding layer's window of 8
    kv_token = 2 * cfg.num_kv_heads * cfg.head_dim * BF16
    got = step_bytes(run.model, routed, contexts, kv_token)
    assert got["layers"] == gpt_oss_expected(path, cfg, routed, contexts)
    assert got["lm_head"] == panels(cfg.vocab_size, cfg.hidden_size)
    assert got["embed"] == len(contexts) * cfg.hidden_size * BF16
    assert got["final_norm"] == cfg.hidden_size * F32
