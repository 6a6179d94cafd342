"""Constrained decoding and logit_bias through the engine (the offline LLM API): every kind,
batches that mix constrained and free requests, n > 1, preemption, failures, cached tokens."""

from __future__ import annotations

import json
import random
import re

import pytest

from cpud import LLM, SamplingParams
from cpud.engine.llm_engine import RequestFailedError
from cpud.engine.outputs import OutputAccumulator
from cpud.settings.errors import RequestError
from cpud.structured.matcher import SequenceConstraint
from cpud.structured.spec import StructuredSpec

REGEX = r"(ab|cd|ef)+"


@pytest.fixture(scope="module")
def llama(model_factory):
    return LLM(model=model_factory("llama"), dtype="float32")


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 400) for _ in range(length)] for _ in range(count)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_choice_and_grammar_outputs_match(llama, temperature):
    cases = [
        (StructuredSpec("regex", r"[A-Z][a-z]{2,5} [0-9]{1,3}"), r"[A-Z][a-z]{2,5} [0-9]{1,3}"),
        (
            StructuredSpec("choice", choices=("alpha", "beta", "gamma delta")),
            "alpha|beta|gamma delta",
        ),
        (
            StructuredSpec("grammar", 'start: "(" ITEM ("," ITEM)* ")"\nITEM: /[xyz]/'),
            r"\([xyz](,[xyz])*\)",
        ),
    ]
    params = [
        SamplingParams(temperature=temperature, seed=seed, max_tokens=64, structured=spec)
        for spec, _ in cases
        for seed in (0, 1)
    ]
    # Brackets and commas may end the grammar's list; favour ")" so a random model closes it.
    close = llama.tokenizer.encode(")", add_special_tokens=False)
    params = [
        SamplingParams(**{**p.__dict__, "logit_bias": {close[-1]: 6.0}}) if i >= 4 else p
        for i, p in enumerate(params)
    ]
    outputs = llama.generate(["Answer:"] * len(params), params)
    patterns = [pattern for _, pattern in cases for _ in (0, 1)]
    for output, pattern in zip(outputs, patterns):
        choice = output.outputs[0]
        assert choice.finish_reason == "stop", choice
        assert re.fullmatch(pattern, choice.text), (pattern, choice.text)


def test_logit_bias_bans_and_forces_tokens(llama):
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = llama.generate("Hello", free)[0].outputs[0].token_ids
    banned = {t: -100 for t in set(first)}
    again = llama.generate("Hello", SamplingParams(**{**free.__dict__, "logit_bias": banned}))
    assert not set(again[0].outputs[0].token_ids) & set(first)
    forced = llama.generate("Hello", SamplingParams(**{**free.__dict__, "logit_bias": {77: 100}}))
    assert forced[0].outputs[0].token_ids == [77] * 8


def test_bad_requests_are_request_errors(llama):
    with pytest.raises(RequestError, match="response_format") as caught:
        llama.generate("x", SamplingParams(structured=StructuredSpec("json", '{"type": 5}')))
    assert caught.value.param == "response_format"
    with pytest.raises(RequestError, match="unclosed") as caught:
        spec = StructuredSpec("regex", "(", source="guided_regex")
        llama.generate("x", SamplingParams(structured=spec))
    assert caught.value.param == "guided_regex"
    vocab = llama.config.model.vocab_size
    with pytest.raises(RequestError, match="outside the vocabulary") as caught:
        llama.generate("x", SamplingParams(logit_bias={vocab: 1.0}))
    assert caught.value.param == "logit_bias"
    assert not llama.engine.has_unfinished()


def test_constrained_rows_leave_their_neighbours_alone(llama):
    """Free requests give the same tokens alone and batched with constrained ones."""
    free = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True),
    ]
    spec = StructuredSpec("json", json.dumps({"type": "array", "items": {"type": "integer"}}))
    constrained = SamplingParams(
        temperature=1.0, seed=4, max_tokens=12, structured=spec, logit_bias={5: 2.0}
    )
    texts = ["The weather today", "Once upon a time"]
    alone = llama.generate(texts, free)
    mixed = llama.generate(texts + ["Numbers:"], free + [constrained])
    for single, batched in zip(alone, mixed):
        assert single.outputs[0].token_ids == batched.outputs[0].token_ids
    assert mixed[2].outputs[0].text.startswith("[")


def test_each_choice_has_its_own_matcher(llama):
    schema = {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 3, "maxItems": 3}
    spec = StructuredSpec("json", json.dumps(schema))
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=40, structured=spec)
    output = llama.generate("Letters:", params)[0]
    values = [json.loads(choice.text) for choice in output.outputs]
    assert all(len(v) == 3 and set(v) <= {"a", "b", "c"} for v in values)
    assert len({tuple(v) for v in values}) > 1  # the choices sampled independently


def test_preemption_does_not_replay_tokens_into_the_matcher(model_factory):
    """Recomputing a preempted sequence recomputes its KV, not its grammar state: the tokens
    are those of a run without preemption and still match."""
    spec = StructuredSpec("regex", REGEX)
    params = SamplingParams(temperature=0, max_tokens=30, structured=spec)
    batch = prompts(3, 50, seed=6)
    roomy = LLM(model_factory("llama"), dtype="float32")
    expected = [o.outputs[0].token_ids for o in roomy.generate(batch, params)]
    small = LLM(
        model_factory("llama"),
        dtype="float32",
        num_kv_blocks=9,
        max_num_batched_tokens=16,
        max_model_len=128,
    )
    outputs = small.generate(batch, params)
    assert small.engine.scheduler.num_preemptions > 0, "the test needs a preemption"
    for output, tokens in zip(outputs, expected):
        assert output.outputs[0].token_ids == tokens
        assert re.fullmatch(REGEX, output.outputs[0].text)


def test_a_token_the_grammar_refuses_fails_only_its_request(llama, monkeypatch):
    """A mask that lets everything through (a broken mask) makes the model sample what the
    grammar refuses: that request fails, the others finish."""
    monkeypatch.setattr(SequenceConstraint, "allowed_mask", lambda self: b"\xff" * 128)
    spec = StructuredSpec("choice", choices=("zzzzzzzz",))
    params = SamplingParams(temperature=0, max_tokens=8, structured=spec)
    with pytest.raises(RequestFailedError, match="reading its new token"):
        llama.generate("Hello", params)
    engine = llama.engine
    engine.isolate_requests = True
    try:
        engine.add_request("bad", llama.tokenizer.encode("Hello"), params)
        free = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        engine.add_request("good", llama.tokenizer.encode("Hello"), free)
        folds: dict[str, OutputAccumulator] = {}
        while engine.has_unfinished():
            for output in engine.step():
                folds.setdefault(output.request_id, OutputAccumulator()).add(output)
        finished = {request_id: fold.result() for request_id, fold in folds.items()}
        assert [request for request, _ in engine.take_failures()] == ["bad"]
        assert len(finished["good"].outputs[0].token_ids) == 4
    finally:
        engine.isolate_requests = False


def test_cached_prompt_tokens_are_reported(llama):
    prompt = prompts(1, 70, seed=9)[0]
    params = SamplingParams(temperature=0, max_tokens=2)
    first = llama.generate([prompt], params)[0]
    second = llama.generate([prompt], params)[0]
    block = llama.config.block_size
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == (len(prompt) - 1) // block * block


def test_two_ranks_give_the_tokens_of_one(model_factory, llama):
    """The mask and the bias travel in the plan to every rank; rank 0 applies them."""
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=20,
            structured=StructuredSpec("regex", REGEX),
            logit_bias={5: 3},
        ),
        SamplingParams(temperature=1.0, seed=2, max_tokens=6, logit_bias={9: 4.0}),
    ]
    expected = [o.outputs[0].token_ids for o in llama.generate(["Hi", "Hi"], params)]
    with LLM(model_factory("llama"), dtype="float32", tp=2) as two:
        outputs = two.generate(["Hi", "Hi"], params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
