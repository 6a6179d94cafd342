"""Speculative decoding with a draft model: greedy output token for token as without it (the
target itself as its draft, a perturbed copy, an unrelated model of the same vocabulary; chunked
prefill, prefix hits, preemption; a Q8_0 GGUF draft in two rank processes), seeded sampling
reproducible whatever the batch, the memory the draft takes, and the configuration's errors."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import load_file, save_file
from test_spec_decode import assert_same, run

from cpud import LLM, SamplingParams
from cpud.ranks import spec_draft
from cpud.settings.errors import ConfigError

K = 4
ENGINE = {"dtype": "float32", "max_model_len": 192}


def draft_config(path: Path, **more) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": K, **more}


def perturbed_copy(src: Path, dst: Path, scale: float) -> Path:
    """The model with noise of `scale` times each matrix's spread added: a draft that agrees
    with it often, not always."""
    shutil.copytree(src, dst)
    generator = torch.Generator().manual_seed(3)
    tensors = load_file(src / "model.safetensors")
    for name, tensor in tensors.items():
        if tensor.dim() == 2:
            noise = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
            tensors[name] = tensor + noise * tensor.std() * scale
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def requests(vocab: int) -> dict[int, list]:
    """By step: a prompt and a later one sharing its first 32 tokens (a prefix hit), a penalised
    one, and a long one prefilled in chunks beside the others' verification."""
    rng = random.Random(5)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(4, vocab) for _ in range(n)]

    greedy = {"temperature": 0, "max_tokens": 20, "ignore_eos": True}
    penalised = dict(greedy, repetition_penalty=1.3, frequency_penalty=0.3)
    shared = prompt(32)
    return {
        0: [
            ("first", [*shared, 5], SamplingParams(**greedy)),
            ("penalised", prompt(21), SamplingParams(**penalised)),
        ],
        3: [
            ("prefix hit", [*shared, 9, 10], SamplingParams(**greedy)),
            ("long prompt", prompt(100), SamplingParams(**greedy)),
        ],
    }


@pytest.fixture(scope="module")
def models(model_factory, tmp_path_factory):
    target = model_factory("qwen3")
    root = tmp_path_factory.mktemp("drafts")
    return {
        "target": target,
        "itself": target,
        "perturbed": perturbed_copy(target, root / "perturbed", 0.03),
        "unrelated": model_factory("qwen3", seed=1),
    }


@pytest.fixture(scope="module")
def reference(models):
    """Greedy outputs without speculation (chunked prefill and prefix hits on the way)."""
    llm = LLM(models["target"], max_num_batched_tokens=48, **ENGINE)
    schedule = requests(llm.config.model.vocab_size)
    return schedule, run(llm, schedule)


@pytest.mark.slow
@pytest.mark.parametrize(
    "draft, engine",
    [
        pytest.param("itself", {"max_num_batched_tokens": 48}, id="itself-chunked-prefix-hits"),
        pytest.param(
            "perturbed", {"num_kv_blocks": 12, "max_num_batched_tokens": 64}, id="preemption"
        ),
        pytest.param("unrelated", {"max_num_batched_tokens": 48}, id="unrelated"),
    ],
)
def test_greedy_tokens_equal_without_speculation(models, reference, draft, engine, monkeypatch):
    schedule, want = reference
    monkeypatch.setattr(spec_draft, "CATCH_UP_CHUNK", 24)  # long prompts catch up in chunks
    llm = LLM(models["target"], speculative_config=draft_config(models[draft]), **ENGINE, **engine)
    assert_same(want, run(llm, schedule))
    stats = llm.engine.spec.stats
    assert stats.num_drafts > 10
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks
    if draft == "itself":  # all accepted but where the target's penalties disagree
        assert stats.num_accepted_tokens > 0.8 * stats.num_draft_tokens
        assert llm.engine.blocks.prefix_hits > 0
    elif draft == "perturbed":  # acceptances and rejections
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert llm.engine.scheduler.num_preemptions > 0
    else:
        assert stats.num_accepted_tokens < 0.1 * stats.num_draft_tokens


@pytest.mark.slow
def test_greedy_tokens_equal_across_two_ranks(models, reference, gguf_file):
    """TP=2: each rank process runs the whole draft (a Q8_0 GGUF file of the target, kept in
    its blocks) and fills in the same proposals."""
    schedule, want = reference
    llm = LLM(
        models["target"],
        speculative_config=draft_config(gguf_file("qwen3", GGMLQuantizationType.Q8_0)),
        max_num_batched_tokens=48,
        tp=2,
        bind="0|1",
        **ENGINE,
    )
    try:
        assert_same(want, run(llm, schedule))
        stats = llm.engine.spec.stats
        assert stats.num_accepted_tokens > 0.5 * stats.num_draft_tokens
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_seeded_sampling_is_reproducible_whatever_the_batch(models):
    llm = LLM(models["target"], speculative_config=draft_config(models["perturbed"]), **ENGINE)
    prompt = list(range(30, 50))
    seeded = SamplingParams(temperature=1.0, top_k=40, seed=11, max_tokens=10, ignore_eos=True)
    others = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    batched = llm.generate([[7, 8, 9], [40] * 9, prompt], [others, others, seeded])
    assert list(batched[-1].outputs[0].token_ids) == list(alone)
    assert llm.engine.spec.stats.num_drafts > 0


def test_config_errors_name_what_to_change(models, tmp_path):
    wide = tmp_path / "wide"
    shutil.copytree(models["unrelated"], wide)
    config = json.loads((wide / "config.json").read_text())
    config["vocab_size"] = 640
    (wide / "config.json").write_text(json.dumps(config))
    cases = [
        (draft_config(wide), "vocabulary has 640 tokens, the target's 576"),
        (draft_config(tmp_path / "missing"), "does not exist"),
        (draft_config(models["unrelated"], draft_tensor_parallel_size=2), "must be 1"),
        (draft_config(models["unrelated"], quantization="q9"), "--quantization must be one of"),
        ({"method": "draft_model", "num_speculative_tokens": K}, 'needs "model"'),
    ]
    for value, words in cases:
        with pytest.raises(ConfigError, match="--speculative-config") as caught:
            LLM(models["target"], speculative_config=value, **ENGINE)
        assert words in str(caught.value)


def test_kv_blocks_and_weights_count_the_draft(models):
    from cpud.settings.config import EngineArgs, resolve_config

    args = EngineArgs(dtype="float32", max_model_len=192, kv_cache_space_gib=0.01)
    plain = resolve_config(args, models["target"])
    with_draft = resolve_config(
        dataclasses.replace(args, speculative_config=draft_config(models["unrelated"])),
        models["target"],
    )
    # the same shape twice per block and in weights: half the blocks in the same space
    assert with_draft.draft_kv_block_bytes > 0
    assert with_draft.num_kv_blocks == plain.num_kv_blocks // 2
    assert with_draft.weight_bytes_per_rank == 2 * plain.weight_bytes_per_rank


def test_engine_reserves_placeholders_with_the_off_switches():
    from types import SimpleNamespace

    from cpud.engine.spec_decode import DRAFT_PLACEHOLDER, PAUSE_STEPS, SpecDecoder
    from cpud.settings.speculative import parse_speculative_config

    config = parse_speculative_config(draft_config(Path("d"), disable_by_batch_size=2))
    decoder = SpecDecoder(config, max_model_len=100)
    assert decoder.needs_history
    seq = SimpleNamespace(
        seq_id=1,
        embed=False,
        constraint=None,
        num_output_tokens=4,
        max_tokens=50,
        num_tokens=12,
        params=SimpleNamespace(min_tokens=0),
    )
    assert decoder.propose(seq, num_running=2) == [DRAFT_PLACEHOLDER] * K
    assert decoder.propose(seq, num_running=3) == []  # above the batch size
    while not decoder.seqs[1].paused:  # nothing accepted, step after step
        decoder.record(1, K, 0)
    assert decoder.seqs[1].paused == PAUSE_STEPS
    assert all(decoder.propose(seq, 1) == [] for _ in range(PAUSE_STEPS))
    seq.max_tokens = 7  # room for two proposals and the model's own token
    assert decoder.propose(seq, num_running=1) == [DRAFT_PLACEHOLDER] * 2
    seq.constraint = object()  # a grammar: the engine cannot mask proposals it does not see
    assert decoder.propose(seq, num_running=1) == []


def test_draft_seq_tracks_what_the_draft_has_seen():
    from cpud.ranks.spec_draft import DraftSeq

    seq = DraftSeq([1, 2, 3])  # the history before a prefix hit's first work
    seq.take(3, [4, 5])
    assert (seq.span(0, 5), seq.computed) == ([1, 2, 3, 4, 5], 0)
    seq.computed = 5
    seq.take(4, [9])  # a rewind past a rejected proposal
    assert (seq.span(0, 5), seq.computed) == ([1, 2, 3, 4, 9], 4)
    seq.take(8, [7])  # tokens it was never told: known from there on only
    assert (seq.offset, seq.computed, seq.span(8, 9)) == (8, 8, [7])
