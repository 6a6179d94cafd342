"""A step's output work does not grow with what a request has generated: outputs are deltas,
logprob entries are built once, token texts decoded once."""

from __future__ import annotations

import pytest

from cpud import LLM, SamplingParams
from cpud.engine.outputs import accumulate


@pytest.fixture(scope="module")
def llm(model_factory):
    return LLM(model_factory("qwen3"), dtype="float32", max_model_len=512)


class CountingDecoder:
    """Counts the tokenizer's decode calls and the token ids they are given."""

    def __init__(self, decode):
        self.decode = decode
        self.calls = 0
        self.tokens = 0

    def __call__(self, token_ids, skip_special_tokens=True):
        self.calls += 1
        self.tokens += len(token_ids)
        return self.decode(token_ids, skip_special_tokens=skip_special_tokens)


def test_logprob_work_per_step_stays_flat_as_the_output_grows(llm, monkeypatch):
    counter = CountingDecoder(llm.tokenizer.decode)
    monkeypatch.setattr(llm.tokenizer, "decode", counter)
    n, top, length = 2, 8, 300
    params = SamplingParams(
        n=n, temperature=1.0, seed=7, max_tokens=length, logprobs=top, ignore_eos=True
    )
    engine = llm.engine
    engine.add_request("hostile", llm.tokenizer.encode("Write"), params)
    decoded_per_step = []
    outputs = []
    while engine.has_unfinished():
        before = counter.tokens
        outputs += engine.step()
        decoded_per_step.append(counter.tokens - before)
    assert len(outputs) == length
    # Each step's output holds only its news: one new token per choice, with its entry.
    for out in outputs:
        for choice in out.outputs:
            assert len(choice.token_ids) == len(choice.logprobs) == 1
    whole = accumulate(outputs)
    for out in whole.outputs:
        assert len(out.logprobs) == len(out.token_ids) == length
        for token, entry in zip(out.token_ids, out.logprobs):
            assert next(iter(entry)) == token and len(entry) <= top + 1
            name = counter.decode([token], skip_special_tokens=False)
            assert entry[token].decoded_token == name


def test_deltas_fold_into_what_the_offline_api_returns(llm):
    engine = llm.engine
    prompt = llm.tokenizer.encode("The quick brown fox")
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True)
    engine.add_request("delta", prompt, params)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == 12
    whole = accumulate(outputs)
    expected = llm.generate([prompt], params)[0]
    assert whole.outputs[0].token_ids == expected.outputs[0].token_ids
    assert whole.outputs[0].text == expected.outputs[0].text
    assert whole.outputs[0].logprobs == expected.outputs[0].logprobs
    assert "".join(o.outputs[0].text for o in outputs) == expected.outputs[0].text
    # the whole output holds plain lists (what JSON and user code expect)
    assert type(whole.outputs[0].token_ids) is list and type(whole.outputs[0].logprobs) is list
