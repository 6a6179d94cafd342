"""Prompt logprobs (vLLM's SamplingParams.prompt_logprobs) against transformers' log-softmax
of the whole prompt's logits: in one step or chunked, after a prefix-cache hit, after
preemption, with n > 1, and with TP=2 rank processes."""

from __future__ import annotations

import random

import msgspec
import pytest
import torch

from cpud import LLM, Logprob, SamplingParams
from cpud.engine.output_builder import TokenNames, add_prompt_logprobs
from cpud.engine.sequence import Sequence
from cpud.engine.step_planner import prompt_scoring
from cpud.protocol.control import FromRank
from cpud.protocol.step import PromptLogprobs, PromptScoring, SeqWork, StepPlan, StepResult
from hf_reference import hf_logits

TOP = 4
TOLERANCE = 1e-4  # fp32 logprobs (magnitude ~1-20), as the fp32 logits parity tests


def prompt(length: int, seed: int = 0, vocab: int = 400) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, vocab) for _ in range(length)]


SCORED = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=TOP)


def check_against(reference: torch.Tensor, prompt_ids: list[int], entries: list) -> None:
    """entries (RequestOutput.prompt_logprobs) against log_softmax(reference logits)."""
    assert len(entries) == len(prompt_ids) and entries[0] is None
    logprobs = reference.log_softmax(-1)
    for position in range(1, len(prompt_ids)):
        row, token, entry = logprobs[position - 1], prompt_ids[position], entries[position]
        want = float(row[token])
        assert entry[token].logprob == pytest.approx(want, abs=TOLERANCE), position
        # the rank of the prompt token, allowing for reference values within the tolerance
        higher, close = int((row > want + TOLERANCE).sum()), int((row > want - TOLERANCE).sum())
        assert higher + 1 <= entry[token].rank <= close + 1, position
        alternatives = {t: lp for t, lp in entry.items() if lp.rank <= TOP}
        assert sorted(lp.rank for lp in alternatives.values()) == list(range(1, TOP + 1))
        best = row.topk(TOP).values
        for other, lp in alternatives.items():
            assert lp.logprob == pytest.approx(float(row[other]), abs=TOLERANCE)
            assert lp.logprob == pytest.approx(float(best[lp.rank - 1]), abs=TOLERANCE)
        assert len(entry) <= TOP + 1


@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 16}])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "opt"])
def test_prompt_logprobs_match_transformers(arch, settings, model_factory, hf_models):
    model_dir = model_factory(arch)
    prompts = [prompt(70, seed=1), prompt(9, seed=2), prompt(1, seed=3)]
    llm = LLM(model_dir, dtype="float32", **settings)
    outputs = llm.generate(prompts, SCORED)
    for prompt_ids, output in zip(prompts, outputs):
        reference = hf_logits(hf_models(model_dir), prompt_ids)
        check_against(reference, prompt_ids, output.prompt_logprobs)
        # the first generated token is the argmax after the whole prompt, as without them
        assert output.outputs[0].token_ids[0] == int(reference[-1].argmax())


def test_bf16_prompt_logprobs_are_the_runners_own_logits(model_factory):
    """bf16 runs the fused native decoder where it is built: the scored rows are the right rows
    of its hidden states."""
    llm = LLM(model_factory("qwen3"), dtype="bfloat16")
    prompt_ids = prompt(70, seed=12)
    entries = llm.generate([prompt_ids], SCORED)[0].prompt_logprobs
    blocks = list(range(-(-len(prompt_ids) // llm.config.block_size)))
    plan = StepPlan(0, [SeqWork(0, prompt_ids, 0, blocks, False)])
    own = llm.engine.executor.runner.prompt_logits(plan).float().log_softmax(-1)
    for position in range(1, len(prompt_ids)):
        token = prompt_ids[position]
        want = float(own[position - 1, token])
        assert entries[position][token].logprob == pytest.approx(want, abs=TOLERANCE)


def test_requests_without_prompt_logprobs_get_none(model_factory):
    llm = LLM(model_factory("qwen3"), dtype="float32")
    output = llm.generate([prompt(20)], SamplingParams(max_tokens=2, temperature=0))[0]
    assert output.prompt_logprobs is None


def test_prefix_cache_is_bypassed_for_scoring_and_fed_by_it(model_factory, hf_models):
    model_dir = model_factory("qwen3")
    reference_model = hf_models(model_dir)
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=40)
    shared = prompt(70, seed=4)
    plain = SamplingParams(max_tokens=2, temperature=0)
    llm.generate([shared], plain)  # caches the shared blocks
    hits = llm.engine.blocks.prefix_hits
    output = llm.generate([shared], SCORED)[0]
    assert llm.engine.blocks.prefix_hits == hits, "a scoring request must compute its prompt"
    check_against(hf_logits(reference_model, shared), shared, output.prompt_logprobs)
    # A scoring request's own blocks are cached for the requests after it.
    fresh = prompt(70, seed=5)
    llm.generate([fresh], SCORED)
    hits = llm.engine.blocks.prefix_hits
    llm.generate([fresh + [7, 8]], plain)
    assert llm.engine.blocks.prefix_hits - hits == 70 // 16


def test_preempted_scoring_sequence_keeps_its_prompt_logprobs(model_factory, hf_models):
    model_dir = model_factory("qwen3")
    prompts = [prompt(60, seed=6), prompt(60, seed=7), prompt(50, seed=8)]
    llm = LLM(
        model_dir, dtype="float32", num_kv_blocks=9, max_num_batched_tokens=16, max_model_len=128
    )
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, prompt_logprobs=TOP)
    outputs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0, "the test needs a preemption"
    for prompt_ids, output in zip(prompts, outputs):
        check_against(
            hf_logits(hf_models(model_dir), prompt_ids), prompt_ids, output.prompt_logprobs
        )


def test_n_choices_share_the_prompt_logprobs(model_factory):
    llm = LLM(model_factory("llama"), dtype="float32")
    prompt_ids = prompt(30, seed=9)
    one = llm.generate([prompt_ids], SCORED)[0]
    many = llm.generate(
        [prompt_ids],
        SamplingParams(n=3, max_tokens=3, temperature=1.0, seed=1, prompt_logprobs=TOP),
    )[0]
    assert len(many.outputs) == 3
    assert len(many.prompt_logprobs) == len(prompt_ids)
    for mine, theirs in zip(many.prompt_logprobs[1:], one.prompt_logprobs[1:]):
        assert mine.keys() == theirs.keys()
        for token in mine:
            assert mine[token].logprob == pytest.approx(theirs[token].logprob, abs=1e-5)


def test_tp2_prompt_logprobs_equal_tp1(model_factory, hf_models):
    model_dir = model_factory("qwen3")
    prompts = [prompt(70, seed=10), prompt(5, seed=11)]
    params = SCORED
    single = LLM(model_dir, dtype="float32", max_num_batched_tokens=24).generate(prompts, params)
    with LLM(model_dir, dtype="float32", tp=2, bind="0|1", max_num_batched_tokens=24) as llm:
        sharded = llm.generate(prompts, params)
    for prompt_ids, one, two in zip(prompts, single, sharded):
        assert two.outputs[0].token_ids == one.outputs[0].token_ids
        check_against(hf_logits(hf_models(model_dir), prompt_ids), prompt_ids, two.prompt_logprobs)
        for mine, theirs in zip(two.prompt_logprobs[1:], one.prompt_logprobs[1:]):
            for token, lp in mine.items():
                assert lp.logprob == pytest.approx(theirs[token].logprob, abs=TOLERANCE)


def sequence(prompt_ids: list[int], top: int | None = 1) -> Sequence:
    return Sequence(0, "r", 0, prompt_ids, SamplingParams(prompt_logprobs=top), None, None)


def test_scoring_plan_per_chunk_and_after_recompute():
    seq = sequence(list(range(10, 50)))  # 40 prompt tokens: positions 0..38 are scored
    assert prompt_scoring(seq, 0, 16) == PromptScoring(0, 16, 1, 26)  # row 15 scores token 16
    with pytest.raises(RuntimeError, match="never scored"):
        prompt_scoring(seq, 32, 8)
    seq.prompt_logprobs.extend([None] * 32)
    assert prompt_scoring(seq, 32, 8) == PromptScoring(0, 7, 1, None)  # position 39 samples
    # recomputed after a preemption: positions already scored are not scored again
    del seq.prompt_logprobs[20:]
    assert prompt_scoring(seq, 0, 32) == PromptScoring(20, 12, 1, 42)
    assert prompt_scoring(seq, 0, 16) is None
    seq.prompt_logprobs.extend([None] * 19)
    assert not seq.needs_prompt_logprobs and prompt_scoring(seq, 0, 40) is None
    assert prompt_scoring(sequence([1, 2, 3], top=None), 0, 3) is None
    assert prompt_scoring(sequence([5]), 0, 1) is None  # one token: nothing to score


def test_prompt_logprobs_cross_the_wire_and_land_in_order():
    from array import array

    seq = sequence([3, 4, 5, 6], top=2)
    values = array("f", [-1.5, -2.5]).tobytes()
    tops = array("f", [-0.5, -1.0, -0.25, -1.5]).tobytes()
    result = StepResult(7, [], 0.1, [PromptLogprobs(0, values, [3, 4], [9, 8, 7, 6], tops)])
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(result), type=FromRank)
    assert decoded == result
    names = TokenNames(NameOnly())
    add_prompt_logprobs(seq, decoded.prompt_logprobs[0], names)
    assert seq.prompt_logprobs == [
        {4: Logprob(-1.5, 3, "t4"), 9: Logprob(-0.5, 1, "t9"), 8: Logprob(-1.0, 2, "t8")},
        {5: Logprob(-2.5, 4, "t5"), 7: Logprob(-0.25, 1, "t7"), 6: Logprob(-1.5, 2, "t6")},
    ]
    assert [list(entry) for entry in seq.prompt_logprobs] == [[4, 9, 8], [5, 7, 6]]
    with pytest.raises(ValueError, match="do not fit"):
        add_prompt_logprobs(seq, decoded.prompt_logprobs[0], names)  # one position is left


class NameOnly:
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"t{t}" for t in token_ids)
