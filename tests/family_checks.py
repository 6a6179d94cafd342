"""The checks every model family shows on its fixture (tests/test_family_*.py): logits against
transformers in fp32 and bf16, greedy tokens (chunked prefill among the engine settings), the
prefix cache, TP=2 against TP=1, and GGUF files of the fixture (F16, Q8_0, Q4_K_M) against
cpud's Hugging Face path on the same weights: the file's tensors dequantized back into a
checkpoint (Q/K rows un-permuted), so the GGUF path's config mapping, tensor names and
permutation are checked tightly whatever the quantization error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize
from gguf_writer import PERMUTED_QK, gguf_name, write_gguf
from safetensors.numpy import load_file, save_file
from test_parity import BF16_MAX_ERROR, BF16_MEAN_ERROR, ENGINE_SETTINGS, engine_logits
from test_tp_sharding import logits_with

from cpud import LLM, SamplingParams
from cpud.model.load import load_model_config
from cpud.protocol.step import SeqWork, StepPlan
from cpud.ranks.model_runner import ModelRunner, RunnerConfig
from cpud.ranks.parallel import SingleRank
from hf_reference import hf_greedy, hf_logits

NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
# test_parity's engine settings for greedy runs; chunked prefill takes a while (slow lane)
GREEDY_SETTINGS = ("default", "torch-kernels", pytest.param("chunked", marks=pytest.mark.slow))


def prompt_of(length: int, seed: int = 0, vocab: int = 400) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(4, vocab, size=length)]


def greedy_prompts() -> list[list[int]]:
    return [prompt_of(n, seed=n) for n in (1, 7, 33, 130)]


def assert_close_fp32(ours: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4 * float(want.std()))


def check_fp32_logits(model_dir: Path, hf_model) -> None:
    prompt = prompt_of(60, seed=4)
    want = hf_logits(hf_model, prompt)
    assert_close_fp32(engine_logits(LLM(model_dir, dtype="float32"), prompt), want)


def check_bf16_logits(model_dir: Path, hf_models, kernels: str) -> None:
    """As test_parity's bf16 test: within the dense tolerances of transformers' fp32 logits
    and about as close as transformers' own bf16 path."""
    prompt = prompt_of(45, seed=3)
    reference = hf_logits(hf_models(model_dir, torch.float32), prompt)
    hf_bf16 = hf_logits(hf_models(model_dir, torch.bfloat16), prompt)
    llm = LLM(model_dir, dtype="bfloat16", kernels=kernels)
    if kernels == "native":
        assert llm.engine.executor.runner.decoder is not None, "not the fused decoder"
    ours = engine_logits(llm, prompt)
    sigma = reference.std()
    ours_err = (ours - reference).abs() / sigma
    hf_err = (hf_bf16 - reference).abs() / sigma
    assert float(ours_err.max()) < BF16_MAX_ERROR, f"bf16 max error {ours_err.max():.3f}σ"
    assert float(ours_err.mean()) < BF16_MEAN_ERROR, f"bf16 mean error {ours_err.mean():.3f}σ"
    assert float(ours_err.max()) <= 1.25 * float(hf_err.max()) + 0.02
    assert float(ours_err.mean()) <= 1.25 * float(hf_err.mean()) + 0.005
    assert float((ours.argmax(-1) == reference.argmax(-1)).float().mean()) >= 0.85


def check_greedy(model_dir: Path, hf_model, settings: str) -> None:
    prompts = greedy_prompts()
    want = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    llm = LLM(model_dir, dtype="float32", **ENGINE_SETTINGS[settings])
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    for prompt, w, g in zip(prompts, want, got):
        assert g == w, f"{settings}: prompt of {len(prompt)} tokens diverged"
    assert len({t for w in want for t in w}) > 8, "the fixture's continuations are degenerate"


def check_prefix_cache(model_dir: Path, hf_model) -> None:
    shared = prompt_of(70, seed=1)
    prompts = [shared + prompt_of(n, seed=10 + n) for n in (3, 20)]
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=40)
    first = llm.generate(prompts[:1], GREEDY)
    hits_before = llm.engine.blocks.prefix_hits
    second = llm.generate(prompts, GREEDY)
    assert llm.engine.blocks.prefix_hits - hits_before >= 2 * (70 // 16)
    assert second[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    for prompt, output in zip(prompts, second):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, NEW_TOKENS)


def check_tp2(path: Path) -> None:
    prompt = [(13 * i) % 400 + 5 for i in range(37)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        full = logits_with(path, prompt, 1)
        sharded = logits_with(path, prompt, 2)
    finally:
        torch.set_num_threads(threads)
    assert_close_fp32(sharded, full)


def runner(path: Path, dtype: torch.dtype = torch.float32, kernels: str = "torch") -> ModelRunner:
    config = RunnerConfig(path, dtype, 512, 16, 32, kernels=kernels, kv_pretouch=False)
    return ModelRunner(config, load_model_config(path), SingleRank())


def prefill_logits(run: ModelRunner, prompt: list[int], chunk: int = 0) -> torch.Tensor:
    """Logits of every prompt token: one step, or chunks of `chunk` tokens (chunked prefill)."""
    chunk = chunk or len(prompt)
    out = []
    for step, start in enumerate(range(0, len(prompt), chunk)):
        part = prompt[start : start + chunk]
        blocks = list(range(-(-(start + len(part)) // 16)))
        plan = StepPlan(step, [SeqWork(0, part, start, blocks, False)])
        out.append(run.prompt_logits(plan).float())
    return torch.cat(out)


def q4_k_m(name: str, shape: tuple[int, ...]) -> T:
    """llama.cpp's Q4_K_M mixture in short: attn_v, ffn_down and output in Q6_K, the rest Q4_K."""
    if ".attn_v." in name or ".ffn_down." in name or name.startswith("output."):
        return T.Q6_K
    return T.Q4_K


def write_fixture_gguf(source: Path, out: Path, qtype: str) -> Path:
    """`source` as a GGUF file of qtype: F16, Q8_0 or Q4_K_M."""
    types = {"F16": T.F16, "Q8_0": T.Q8_0, "Q4_K_M": q4_k_m}
    out.mkdir(parents=True, exist_ok=True)
    return write_gguf(source, out / f"model-{qtype}.gguf", types[qtype])


def gguf_pairs(arch: str, gguf_file, tmp_path_factory):
    """qtype ("F16", "Q8_0", "Q4_K_M") -> (the arch's fixture as a GGUF file of that type, the
    file's weights dequantized as a Hugging Face checkpoint); Q4_K_M from the K-quant shape."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(qtype: str) -> tuple[Path, Path]:
        if qtype not in made:
            source = gguf_file.source(arch, T.Q4_K if qtype == "Q4_K_M" else T.F32)
            root = tmp_path_factory.mktemp(f"{arch}-{qtype}")
            path = write_fixture_gguf(source, root, qtype)
            made[qtype] = (path, dequantized_checkpoint(path, source, root / "dequantized"))
        return made[qtype]

    return get


def _unpermute(values: np.ndarray, heads: int) -> np.ndarray:
    """gguf_writer.permute undone: adjacent RoPE pairs back to rotate-half halves."""
    shape = values.shape
    return (
        values.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
    )


def dequantized_checkpoint(path: Path, source: Path, out: Path) -> Path:
    """The GGUF file's tensors, dequantized to float32 with their Q/K rows un-permuted, as a
    copy of the fixture directory `source` it was written from."""
    shutil.copytree(source, out)
    config = json.loads((source / "config.json").read_text())
    model_type = config["model_type"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    stored = {t.name: t for t in GGUFReader(path).tensors}
    tensors = {}
    for hf, original in load_file(str(source / "model.safetensors")).items():
        tensor = stored[gguf_name(hf, model_type)]
        values = dequantize(tensor.data, tensor.tensor_type).reshape(original.shape)
        if model_type in PERMUTED_QK and ".attn_q." in tensor.name:
            values = _unpermute(values, heads)
        elif model_type in PERMUTED_QK and ".attn_k." in tensor.name:
            values = _unpermute(values, kv_heads)
        tensors[hf] = np.ascontiguousarray(values, dtype=np.float32)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config))
    return out


def check_gguf_against_its_weights(path: Path, dequantized: Path) -> None:
    """The GGUF file through cpud's GGUF path (torch kernels: dense fp32) gives the logits of
    its weights through cpud's Hugging Face path, in one step and in chunks."""
    prompt = prompt_of(50, seed=7)
    want = prefill_logits(runner(dequantized), prompt)
    assert_close_fp32(prefill_logits(runner(path), prompt), want)
    assert_close_fp32(prefill_logits(runner(path), prompt, chunk=16), want)


def check_f16_close_to_checkpoint(path: Path, model_dir: Path) -> None:
    """An F16 file against the fp32 checkpoint it was written from: only the weights' F16
    rounding differs (measured up to 0.027σ on these fixtures)."""
    prompt = prompt_of(50, seed=7)
    want = prefill_logits(runner(model_dir), prompt)
    error = (prefill_logits(runner(path), prompt) - want).abs() / want.std()
    assert float(error.max()) < 0.05, float(error.max())


def check_quantized_kernels(
    path: Path, dequantized: Path, dtype: torch.dtype, max_error: float = 0.6, mean_error=0.05
) -> None:
    """The native quantized GEMM (int8 activations) on the file's blocks against the same
    weights dense in fp32: test_gguf_quantized's bounds (two layers), in units of the logits'
    σ, unless a deeper fixture's own are given."""
    prompt = prompt_of(40, seed=1)
    want = prefill_logits(runner(dequantized), prompt)
    run = runner(path, dtype, kernels="native")
    assert run.decoder is not None, "not the fused decoder"
    got = prefill_logits(run, prompt)
    error = (got - want).abs() / want.std()
    assert float(error.max()) < max_error, (error.max(), error.mean())
    assert float(error.mean()) < mean_error, (error.max(), error.mean())
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.8


def greedy_prefixes(path: Path, reference: Path, kernels: str) -> list[int]:
    """How many leading greedy tokens (of NEW_TOKENS) the GGUF file gives as `reference` does,
    per prompt (fp32 activations)."""
    prompts = [prompt_of(5 + 3 * s, seed=s) for s in range(8)]
    kw = dict(dtype="float32", kernels=kernels, weight_cache="off")
    want = [o.outputs[0].token_ids for o in LLM(reference, **kw).generate(prompts, GREEDY)]
    got = [o.outputs[0].token_ids for o in LLM(path, **kw).generate(prompts, GREEDY)]
    return [
        next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), NEW_TOKENS)
        for g, w in zip(got, want)
    ]
