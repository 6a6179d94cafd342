"""The checks every model family shows on its fixture (tests/test_family_*.py), as helpers and as
two base classes that a family module subclasses, stating only what its family changes:

- TransformersChecks: logits against transformers in fp32 and bf16 (torch and native kernels),
  greedy tokens under test_parity's engine settings (chunked prefill among them), the prefix
  cache, TP=2 against TP=1, on the module's `model_dir` fixture.
- GGUFWeightChecks: GGUF files of the fixture (F16, Q8_0, Q4_K_M) against cpud's Hugging Face
  path on the same weights: the file's tensors dequantized back into a checkpoint (Q/K rows
  un-permuted), so the GGUF path's config mapping, tensor names and permutation are checked
  tightly whatever the quantization error; the native quantized GEMM within bounds of them.

Work two tests would repeat (transformers' greedy tokens, a model's logits or greedy tokens) is
done once per class by its fixtures."""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize
from gguf_writer import PERMUTED_QK, gguf_name, write_gguf
from safetensors.numpy import load_file, save_file
from test_gguf_quantized import DTYPES, prefill_logits
from test_parity import (
    BF16_MAX_ERROR,
    BF16_MEAN_ERROR,
    ENGINE_SETTINGS,
    engine_logits,
    make_prompts,
)
from test_tp_sharding import logits_with

from cpud import LLM, SamplingParams, native
from cpud.model.load import load_model_config
from cpud.ranks.fused_decoder import FusedDecoder
from cpud.ranks.model_runner import ModelRunner, RunnerConfig
from cpud.ranks.parallel import SingleRank
from hf_reference import hf_greedy, hf_logits

NEW_TOKENS = 12
QTYPES = ("F16", "Q8_0", "Q4_K_M")
needs_native = pytest.mark.skipif(not native.available(), reason="native kernels not built")
KERNELS = ("torch", pytest.param("native", marks=needs_native))
# test_parity's engine settings for greedy runs: native kernels, torch kernels, chunked prefill
GREEDY_SETTINGS = ("default", "torch-kernels", "chunked")
TP_PROMPT = [(13 * i) % 400 + 5 for i in range(37)]


def greedy(new_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)


def prompt_of(length: int, seed: int = 0, vocab: int = 400) -> list[int]:
    """`length` random token ids in 4 .. vocab - 1 (numpy's generator)."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(4, vocab, size=length)]


def parity_prompt(length: int, seed: int = 0, vocab: int = 500) -> list[int]:
    """test_parity's random prompt (Python's generator): `length` token ids in 4 .. vocab - 1.
    The fixtures' bf16 and quantized errors swing with the prompt (transformers' own bf16 path
    lands anywhere in 0.2 .. 1.3σ on smollm3's), so each family keeps the prompts its bounds
    were measured on."""
    return make_prompts(vocab, (length,), seed)[0]


def sigma_error(ours: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """|ours - reference| in units of the reference logits' standard deviation σ."""
    return (ours - reference).abs() / reference.std()


def assert_close_fp32(ours: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4 * float(want.std()))


def assert_bf16_close(ours: torch.Tensor, reference: torch.Tensor, hf_bf16: torch.Tensor) -> None:
    """test_parity's dense bf16 tolerances: within BF16_MAX_ERROR / BF16_MEAN_ERROR of
    transformers' fp32 logits, and about as close to them as transformers' own bf16 path."""
    ours_err, hf_err = sigma_error(ours, reference), sigma_error(hf_bf16, reference)
    assert float(ours_err.max()) < BF16_MAX_ERROR, f"bf16 max error {ours_err.max():.3f}σ"
    assert float(ours_err.mean()) < BF16_MEAN_ERROR, f"bf16 mean error {ours_err.mean():.3f}σ"
    assert float(ours_err.max()) <= 1.25 * float(hf_err.max()) + 0.02
    assert float(ours_err.mean()) <= 1.25 * float(hf_err.mean()) + 0.005
    assert float((ours.argmax(-1) == reference.argmax(-1)).float().mean()) >= 0.85


def assert_quantized_close(
    got: torch.Tensor, want: torch.Tensor, bounds: tuple[float, float, float] = (0.6, 0.05, 0.8)
) -> None:
    """The native quantized GEMM (activations rounded to int8) against the same weights dense
    in fp32: max and mean error in units of σ below bounds[:2], argmax agreement at least
    bounds[2] (test_gguf_quantized's bounds, measured on two layers, unless a deeper fixture's
    own are given)."""
    error = sigma_error(got, want)
    assert float(error.max()) < bounds[0], (error.max(), error.mean())
    assert float(error.mean()) < bounds[1], (error.max(), error.mean())
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= bounds[2]


def check_fp32_logits(
    model_dir: Path, hf_model, kernels: str = "auto", prompt: list[int] | None = None
) -> None:
    prompt = prompt or prompt_of(60, seed=4)
    want = hf_logits(hf_model, prompt)
    llm = LLM(model_dir, dtype="float32", kernels=kernels)
    assert_close_fp32(engine_logits(llm, prompt), want)


def check_bf16_logits(
    model_dir: Path, hf_models, kernels: str, prompt: list[int] | None = None
) -> None:
    """bf16 within the dense tolerances of transformers' fp32 logits (assert_bf16_close); on
    the native kernels through the fused decoder."""
    prompt = prompt or prompt_of(45, seed=3)
    reference = hf_logits(hf_models(model_dir, torch.float32), prompt)
    hf_bf16 = hf_logits(hf_models(model_dir, torch.bfloat16), prompt)
    llm = LLM(model_dir, dtype="bfloat16", kernels=kernels)
    if kernels == "native":
        assert isinstance(llm.engine.executor.runner.decoder, FusedDecoder), "not fused"
    assert_bf16_close(engine_logits(llm, prompt), reference, hf_bf16)


def check_greedy(
    model_dir: Path, prompts: list[list[int]], expected: list[list[int]], settings: str
) -> None:
    """cpud's greedy tokens under one of test_parity's ENGINE_SETTINGS are `expected`."""
    llm = LLM(model_dir, dtype="float32", **ENGINE_SETTINGS[settings])
    outputs = llm.generate(prompts, greedy(len(expected[0])))
    for prompt, want, output in zip(prompts, expected, outputs):
        assert output.outputs[0].token_ids == want, f"{settings}: {len(prompt)} tokens diverged"
        assert output.outputs[0].finish_reason == "length"
    assert len({t for w in expected for t in w}) > 8, "the fixture's continuations are degenerate"


def check_prefix_cache(
    model_dir: Path,
    prompts: list[list[int]],
    shared: int,
    reference: Callable[[list[int]], list[int]],
    batched_tokens: int = 40,
) -> None:
    """`prompts` sharing their first `shared` tokens, the first run alone before all of them:
    the second run reuses every full block of the shared part for each prompt, and the tokens
    are the first run's and `reference`'s (transformers' greedy tokens of a prompt)."""
    assert all(p[:shared] == prompts[0][:shared] for p in prompts)
    expected = [reference(p) for p in prompts]
    params = greedy(len(expected[0]))
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=batched_tokens)
    first = llm.generate(prompts[:1], params)
    hits_before = llm.engine.blocks.prefix_hits
    second = llm.generate(prompts, params)
    assert llm.engine.blocks.prefix_hits - hits_before >= len(prompts) * (shared // 16)
    assert second[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    assert [o.outputs[0].token_ids for o in second] == expected


def check_tp2(path: Path, prompt: list[int] = TP_PROMPT) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        full = logits_with(path, prompt, 1)
        sharded = logits_with(path, prompt, 2)
    finally:
        torch.set_num_threads(threads)
    assert_close_fp32(sharded, full)


class TransformersChecks:
    """The module's `model_dir` against transformers. A subclass changes the prompts below, or
    reference_greedy where transformers needs help to give its family's reference tokens."""

    prompt = staticmethod(prompt_of)  # (length, seed) -> prompt
    fp32_length = 60  # prompt tokens of the fp32 logits check
    bf16_length = 45  # of the bf16 one (test_parity's bf16 tolerances were measured on 45)
    greedy_lengths: tuple[int, ...] = (1, 7, 33, 130)
    new_tokens = NEW_TOKENS
    prefix_shared = 70  # check_prefix_cache's parameters
    prefix_suffixes: tuple[int, ...] = (3, 20)
    prefix_batched_tokens = 40

    def reference_greedy(self, model, prompt: list[int], new_tokens: int) -> list[int]:
        return hf_greedy(model, prompt, new_tokens)

    @pytest.fixture(scope="class")
    def greedy_reference(self, model_dir, hf_models) -> tuple[list, list]:
        """The greedy prompts and transformers' tokens for them, for every engine setting."""
        model = hf_models(model_dir)
        prompts = [self.prompt(n, seed=n) for n in self.greedy_lengths]
        return prompts, [self.reference_greedy(model, p, self.new_tokens) for p in prompts]

    @pytest.mark.parametrize("kernels", KERNELS)
    def test_fp32_logits_match_transformers(self, kernels, model_dir, hf_models):
        prompt = self.prompt(self.fp32_length, seed=4)
        check_fp32_logits(model_dir, hf_models(model_dir), kernels, prompt)

    @pytest.mark.parametrize("kernels", KERNELS)
    def test_bf16_logits_close_to_transformers(self, kernels, model_dir, hf_models):
        prompt = self.prompt(self.bf16_length, seed=3)
        check_bf16_logits(model_dir, hf_models, kernels, prompt)

    @pytest.mark.parametrize("settings", GREEDY_SETTINGS)
    def test_greedy_tokens_match_transformers(self, settings, model_dir, greedy_reference):
        check_greedy(model_dir, *greedy_reference, settings)

    def test_prefix_cache_keeps_tokens(self, model_dir, hf_models):
        model = hf_models(model_dir)
        common = self.prompt(self.prefix_shared, seed=1)
        prompts = [common + self.prompt(n, seed=10 + n) for n in self.prefix_suffixes]
        check_prefix_cache(
            model_dir,
            prompts,
            self.prefix_shared,
            lambda prompt: self.reference_greedy(model, prompt, self.new_tokens),
            self.prefix_batched_tokens,
        )

    def test_tp2_logits_equal_tp1(self, model_dir):
        check_tp2(model_dir)


# --- GGUF --------------------------------------------------------------------------------------

GGUF_PROMPT = prompt_of(50, seed=7)
QUANTIZED_PROMPT = prompt_of(40, seed=1)
GGUF_GREEDY_PROMPTS = [prompt_of(5 + 3 * s, seed=s) for s in range(8)]


def runner(path: Path, dtype: torch.dtype = torch.float32, kernels: str = "torch") -> ModelRunner:
    config = RunnerConfig(path, dtype, 512, 16, 32, kernels=kernels, kv_pretouch=False)
    return ModelRunner(config, load_model_config(path), SingleRank())


def q4_k_m(name: str, shape: tuple[int, ...]) -> T:
    """llama.cpp's Q4_K_M mixture in short: attn_v, ffn_down and output in Q6_K, the rest Q4_K."""
    if ".attn_v." in name or ".ffn_down." in name or name.startswith("output."):
        return T.Q6_K
    return T.Q4_K


def gguf_files(
    root: Path, source_of: Callable[[str], Path], mixture: Callable = q4_k_m
) -> Callable[[str], tuple[Path, Path]]:
    """qtype ("F16", "Q8_0", "Q4_K_M": `mixture`) -> (a GGUF file of that type under root,
    written once from the Hugging Face directory source_of(qtype), that directory)."""

    @functools.cache
    def get(qtype: str) -> tuple[Path, Path]:
        source = source_of(qtype)
        types = mixture if qtype == "Q4_K_M" else T[qtype]
        return write_gguf(source, root / f"{qtype}.gguf", types), source

    return get


def gguf_pairs(arch: str, gguf_file, root: Path) -> Callable[[str], tuple[Path, Path]]:
    """qtype -> (the arch's fixture as a GGUF file of that type, the file's weights dequantized
    as a Hugging Face checkpoint); Q4_K_M from the K-quant shape."""
    files = gguf_files(root, lambda q: gguf_file.source(arch, T.Q4_K if q == "Q4_K_M" else T.F32))

    @functools.cache
    def get(qtype: str) -> tuple[Path, Path]:
        path, source = files(qtype)
        return path, dequantized_checkpoint(path, source, root / f"{qtype}-dequantized")

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


def common_prefixes(got: list[list[int]], want: list[list[int]]) -> list[int]:
    """Per prompt, how many leading tokens `got` has as `want` does."""
    return [
        next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        for g, w in zip(got, want)
    ]


class GGUFWeightChecks:
    """The `arch` fixture's GGUF files (`gguf_pair`) against their own weights through cpud's
    Hugging Face path (torch kernels: dense fp32), in one step and in chunks; the F16 file
    against the checkpoint it was written from; the native quantized GEMM within
    `quantized_bounds` (assert_quantized_close) of the dense weights; TP=2."""

    arch: str
    quantized_bounds = (0.6, 0.05, 0.8)  # assert_quantized_close's

    @pytest.fixture(scope="class")
    def gguf_pair(self, gguf_file, tmp_path_factory):
        return gguf_pairs(self.arch, gguf_file, tmp_path_factory.mktemp(f"{self.arch}-gguf"))

    @pytest.fixture(scope="class")
    def dense_logits(self) -> Callable[[Path, tuple[int, ...]], torch.Tensor]:
        """(checkpoint or file, prompt) -> its logits, torch kernels in fp32 (once each)."""
        return functools.cache(lambda path, prompt: prefill_logits(runner(path), list(prompt)))

    @pytest.fixture(scope="class")
    def greedy_tokens(self) -> Callable[[Path, str], list[list[int]]]:
        """(checkpoint or file, kernels) -> its greedy tokens for GGUF_GREEDY_PROMPTS, fp32."""

        @functools.cache
        def get(path: Path, kernels: str) -> list[list[int]]:
            llm = LLM(path, dtype="float32", kernels=kernels, weight_cache="off")
            return [o.outputs[0].token_ids for o in llm.generate(GGUF_GREEDY_PROMPTS, greedy())]

        return get

    @pytest.mark.parametrize("qtype", QTYPES)
    def test_gguf_logits_equal_its_weights_through_the_hf_path(
        self, qtype, gguf_pair, dense_logits
    ):
        path, dequantized = gguf_pair(qtype)
        want = dense_logits(dequantized, tuple(GGUF_PROMPT))
        assert_close_fp32(dense_logits(path, tuple(GGUF_PROMPT)), want)
        assert_close_fp32(prefill_logits(runner(path), GGUF_PROMPT, chunk=16), want)

    def test_gguf_f16_logits_close_to_the_checkpoint(self, gguf_pair, model_dir, dense_logits):
        """Only the weights' F16 rounding differs (measured up to 0.027σ on these fixtures)."""
        prompt = tuple(GGUF_PROMPT)
        error = sigma_error(
            dense_logits(gguf_pair("F16")[0], prompt), dense_logits(model_dir, prompt)
        )
        assert float(error.max()) < 0.05, float(error.max())

    @pytest.mark.slow
    def test_gguf_f16_greedy_tokens(self, gguf_pair, model_dir, greedy_tokens):
        """Equal to the file's own weights through the Hugging Face path; against the fp32
        checkpoint, F16 rounding may flip a near tie (these fixtures' logits lie close)."""
        path, dequantized = gguf_pair("F16")
        got = greedy_tokens(path, "torch")
        assert common_prefixes(got, greedy_tokens(dequantized, "torch")) == [NEW_TOKENS] * 8
        prefixes = common_prefixes(got, greedy_tokens(model_dir, "torch"))
        assert sum(p == NEW_TOKENS for p in prefixes) >= 6, prefixes

    @needs_native
    @pytest.mark.slow
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K_M"])
    def test_gguf_quantized_kernels_close(self, qtype, dtype, gguf_pair, dense_logits):
        path, dequantized = gguf_pair(qtype)
        run = runner(path, DTYPES[dtype], kernels="native")
        assert isinstance(run.decoder, FusedDecoder)
        want = dense_logits(dequantized, tuple(QUANTIZED_PROMPT))
        assert_quantized_close(prefill_logits(run, QUANTIZED_PROMPT), want, self.quantized_bounds)

    @needs_native
    @pytest.mark.slow
    @pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K_M"])
    def test_gguf_quantized_greedy_tokens(self, qtype, gguf_pair, greedy_tokens):
        """Against the file's own weights dense: int8 activations flip near ties, after which
        the continuations part, so the first tokens must agree."""
        path, dequantized = gguf_pair(qtype)
        got, want = greedy_tokens(path, "native"), greedy_tokens(dequantized, "native")
        prefixes = common_prefixes(got, want)
        assert sum(p > 0 for p in prefixes) >= 6 and sum(prefixes) >= 4 * len(prefixes), prefixes

    def test_gguf_tp2_logits_equal_tp1(self, gguf_pair):
        check_tp2(gguf_pair("F16")[0])
