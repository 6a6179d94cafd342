"""Greedy tokens and logits against Hugging Face transformers on the same directories."""

from __future__ import annotations

import random

import pytest
import torch

from cpud import LLM, SamplingParams
from cpud.protocol.step import SeqWork, StepPlan
from hf_reference import ARCHS, hf_greedy, hf_logits

NEW_TOKENS = 16
PROMPT_LENGTHS = (1, 7, 33, 130, 301)
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def make_prompts(vocab: int, lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def reference(model_factory, hf_models):
    """Per arch: (model dir, prompts, transformers' greedy tokens for each prompt)."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            model_dir = model_factory(arch)
            model = hf_models(model_dir)
            prompts = make_prompts(model.config.vocab_size)
            cache[arch] = (model_dir, prompts, [hf_greedy(model, p, NEW_TOKENS) for p in prompts])
        return cache[arch]

    return get


ENGINE_SETTINGS = {
    "default": {},  # native kernels where built
    "torch-kernels": {"kernels": "torch"},
    # Small chunks: the 301-token prompt is prefilled over ~13 steps, mixed with decodes.
    "chunked": {"max_num_batched_tokens": 24},
    "block128": {"block_size": 128, "max_num_batched_tokens": 100},
}


@pytest.mark.parametrize("settings", list(ENGINE_SETTINGS))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers_fp32(arch, settings, reference):
    model_dir, prompts, expected = reference(arch)
    llm = LLM(model_dir, dtype="float32", **ENGINE_SETTINGS[settings])
    outputs = llm.generate(prompts, GREEDY)
    got = [o.outputs[0].token_ids for o in outputs]
    for prompt, want, have in zip(prompts, expected, got):
        assert have == want, f"{arch}/{settings}: prompt of {len(prompt)} tokens diverged"
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert [o.prompt_token_ids for o in outputs] == prompts


@pytest.mark.parametrize("arch", ["llama", "qwen3", "opt"])
def test_prefix_cache_hits_keep_tokens_identical(arch, model_factory, hf_models):
    model_dir = model_factory(arch)
    model = hf_models(model_dir)
    rng = random.Random(1)
    shared = [rng.randrange(4, model.config.vocab_size) for _ in range(70)]
    prompts = [
        shared + [rng.randrange(4, model.config.vocab_size) for _ in range(n)] for n in (3, 20)
    ]
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=40)
    first = llm.generate(prompts[:1], GREEDY)
    hits_before = llm.engine.blocks.prefix_hits
    second = llm.generate(prompts, GREEDY)
    hits = llm.engine.blocks.prefix_hits - hits_before
    assert hits >= 2 * (70 // 16), "the shared 70-token prefix should hit 4 cached blocks twice"
    assert second[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    for prompt, output in zip(prompts, second):
        assert output.outputs[0].token_ids == hf_greedy(model, prompt, NEW_TOKENS)
    # An exact repeat: every full block but the one holding the last token is reused.
    third = llm.generate(prompts[1:], GREEDY)
    assert third[0].outputs[0].token_ids == second[1].outputs[0].token_ids


def test_sharded_checkpoint_loads_like_single_file(model_factory):
    single = model_factory("qwen2")
    sharded = model_factory("qwen2", max_shard_bytes=40_000)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    prompts = make_prompts(400, lengths=(5, 40))
    a = LLM(single, dtype="float32").generate(prompts, GREEDY)
    b = LLM(sharded, dtype="float32").generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def engine_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    runner = llm.engine.executor.runner
    blocks = list(range(-(-len(prompt) // llm.config.block_size)))
    plan = StepPlan(0, [SeqWork(0, prompt, 0, blocks, False)])
    return runner.prompt_logits(plan).float()


# bf16 tolerances, in units of the fp32 logits' standard deviation σ. bf16 keeps 8 mantissa
# bits, so each layer adds ~0.4% error; over 45 positions x vocab the worst logit lands at
# 0.1-0.45σ for transformers' own bf16 path on these fixtures. cpud must be as close to the
# fp32 reference as that path is (within 25%).
BF16_MAX_ERROR = 0.5  # max |cpud_bf16 - hf_fp32| / σ, absolute cap
BF16_MEAN_ERROR = 0.05  # mean |cpud_bf16 - hf_fp32| / σ


@pytest.mark.parametrize("kernels", ["native", "torch"])
@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_logits_close_to_transformers(arch, kernels, model_factory, hf_models):
    model_dir = model_factory(arch)
    prompt = make_prompts(400, lengths=(45,), seed=3)[0]
    reference = hf_logits(hf_models(model_dir, torch.float32), prompt)
    hf_bf16 = hf_logits(hf_models(model_dir, torch.bfloat16), prompt)
    ours = engine_logits(LLM(model_dir, dtype="bfloat16", kernels=kernels), prompt)
    sigma = reference.std()
    ours_err = (ours - reference).abs() / sigma
    hf_err = (hf_bf16 - reference).abs() / sigma
    assert float(ours_err.max()) < BF16_MAX_ERROR, f"bf16 max error {ours_err.max():.3f}σ"
    assert float(ours_err.mean()) < BF16_MEAN_ERROR, f"bf16 mean error {ours_err.mean():.3f}σ"
    assert float(ours_err.max()) <= 1.25 * float(hf_err.max()) + 0.02
    assert float(ours_err.mean()) <= 1.25 * float(hf_err.mean()) + 0.005
    assert float((ours.argmax(-1) == reference.argmax(-1)).float().mean()) >= 0.85


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_prompt_logits_match(arch, model_factory, hf_models):
    model_dir = model_factory(arch)
    prompt = make_prompts(400, lengths=(60,), seed=4)[0]
    reference = hf_logits(hf_models(model_dir), prompt)
    ours = engine_logits(LLM(model_dir, dtype="float32"), prompt)
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4 * float(reference.std()))


def test_llama_attention_bias_checkpoint(model_factory, hf_models, tmp_path):
    """attention_bias=True puts biases on q, k, v and o (Qwen2 has them on q, k, v only)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "llama-bias"
    shutil.copytree(model_factory("llama"), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["attention_bias"] = True
    (model_dir / "config.json").write_text(json.dumps(config))
    tensors = load_file(model_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name in list(tensors):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if name.endswith(f"self_attn.{proj}.weight"):
                rows = tensors[name].shape[0]
                tensors[name.replace(".weight", ".bias")] = 0.1 * torch.randn(
                    rows, generator=generator
                )
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    prompt = make_prompts(400, lengths=(20,), seed=5)[0]
    reference = hf_logits(hf_models(model_dir), prompt)
    ours = engine_logits(LLM(model_dir, dtype="float32"), prompt)
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4 * float(reference.std()))
