"""A step's output work does not grow with what a request has generated: logprob entries are
built once and kept, token texts decoded once, running outputs are constant-time snapshots."""

from __future__ import annotations

import pytest

from cpud import LLM, SamplingParams
from cpud.engine.outputs import Snapshot


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
    # Per choice and step: the detokenizer's two windows (a few tokens each) and the names of
    # at most top + 1 tokens not seen before; the old output rebuilt every entry every step.
    bound = n * (2 * 8 + top + 1)
    late = decoded_per_step[-50:]
    assert max(late) <= bound, f"late steps decoded {max(late)} tokens (bound {bound})"
    # Entries are built once: a later output holds the very objects an earlier one did.
    early, final = outputs[10].outputs[0], outputs[-1].outputs[0]
    assert len(early.logprobs) == 11 and len(early.token_ids) == 11
    assert all(a is b for a, b in zip(early.logprobs, final.logprobs))
    for out in outputs[-1].outputs:
        assert len(out.logprobs) == len(out.token_ids) == length
        for token, entry in zip(out.token_ids, out.logprobs):
            assert next(iter(entry)) == token and len(entry) <= top + 1
            name = counter.decode([token], skip_special_tokens=False)
            assert entry[token].decoded_token == name


def test_running_outputs_keep_what_they_held_while_the_request_goes_on(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True)
    engine.add_request("snap", llm.tokenizer.encode("The quick brown fox"), params)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    first, final = outputs[0].outputs[0], outputs[-1].outputs[0]
    assert len(first.token_ids) == len(first.logprobs) == 1
    assert first.token_ids == final.token_ids[:1] and list(first.token_ids) == [final.token_ids[0]]
    # the finished output holds plain lists (what JSON and user code expect)
    assert type(final.token_ids) is list and type(final.logprobs) is list
    assert len(final.token_ids) == 12


def test_snapshot_reads_like_the_list_it_was_made_from():
    items = [10, 11, 12, 13]
    snap = Snapshot(items, 1)
    items += [14, 15]
    assert len(snap) == 3 and snap == [11, 12, 13] and list(snap) == [11, 12, 13]
    assert snap[0] == 11 and snap[-1] == 13 and snap[1:] == [12, 13] and snap[::-1] == [13, 12, 11]
    assert (
        snap[5:] == []
        and snap[-10:1] == [11]
        and snap != [11, 12]
        and snap == Snapshot(items, 1, 4)
    )
    with pytest.raises(IndexError):
        snap[3]
    with pytest.raises(IndexError):
        snap[-4]
    assert (snap or None) is snap and not Snapshot(items, 2, 2)
    assert repr(snap) == "[11, 12, 13]"
