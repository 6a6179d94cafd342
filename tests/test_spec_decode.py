"""Speculative decoding in the engine: greedy output token for token as without it (prefix-cache
hits, preemption, chunked prefill beside verifying sequences, penalties, logprobs, stop tokens
and max_tokens), the adaptive off-switches, and the counters."""

from __future__ import annotations

import random
import re

import pytest
from spec_oracle import OracleIndex, use_oracle

from cpud import LLM, SamplingParams
from cpud.engine import spec_decode
from cpud.engine.outputs import OutputAccumulator
from cpud.engine.spec_decode import PAUSE_STEPS, SpecDecoder
from cpud.settings.speculative import SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
GREEDY = {"temperature": 0, "max_tokens": 40, "ignore_eos": True}


def run(llm: LLM, schedule: dict[int, list]) -> dict[str, list]:
    """Admit each request at its step, run to the end; (token ids, logprob entries) per
    request's first choice."""
    engine = llm.engine
    folds: dict[str, OutputAccumulator] = {}
    step = 0
    while step <= max(schedule) or engine.has_unfinished():
        for request_id, prompt, params in schedule.get(step, []):
            engine.add_request(request_id, prompt, params)
        for out in engine.step():
            folds.setdefault(out.request_id, OutputAccumulator()).add(out)
        step += 1
    if hasattr(engine.executor, "runner"):
        assert set(engine.executor.runner.seqs.held) == engine.planner.to_drop
    results = {}
    for rid, fold in folds.items():
        out = fold.result().outputs[0]
        results[rid] = (list(out.token_ids), out.logprobs, out.finish_reason)
    return results


def requests(vocab: int) -> dict[int, list]:
    rng = random.Random(5)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(4, vocab) for _ in range(n)]

    shared = prompt(40)
    penalised = dict(GREEDY, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3)
    return {
        0: [
            ("plain", prompt(23), SamplingParams(**GREEDY)),
            ("first", [*shared, 5], SamplingParams(**GREEDY)),
            ("penalised", prompt(31), SamplingParams(**penalised)),
        ],
        3: [
            ("logprobs", prompt(17), SamplingParams(**GREEDY, logprobs=2)),
            ("prefix hit", [*shared, 9, 10], SamplingParams(**GREEDY)),
            ("long prompt", prompt(120), SamplingParams(**GREEDY)),  # prefilled in chunks
        ],
        6: [("short", prompt(12), SamplingParams(**dict(GREEDY, max_tokens=7)))],
    }


def compare(model_dir, monkeypatch, schedule_of, **engine):
    reference_llm = LLM(model_dir, dtype="float32", max_model_len=192, **engine)
    schedule = schedule_of(reference_llm.config.model.vocab_size)
    reference = run(reference_llm, schedule)
    continuations = {
        tuple(prompt): reference[rid][0] for items in schedule.values() for rid, prompt, _ in items
    }
    use_oracle(monkeypatch, continuations, reference_llm.config.model.vocab_size)
    llm = LLM(model_dir, dtype="float32", max_model_len=192, speculative_config=NGRAM, **engine)
    speculated = run(llm, schedule)
    return reference_llm, reference, llm, speculated


def assert_same(reference: dict, speculated: dict) -> None:
    assert set(reference) == set(speculated)
    for rid, (tokens, logprobs, reason) in reference.items():
        got_tokens, got_logprobs, got_reason = speculated[rid]
        assert got_tokens == tokens, rid
        assert got_reason == reason, rid
        if logprobs is not None:
            for want, got in zip(logprobs, got_logprobs, strict=True):
                assert list(want) == list(got), rid
                for token, entry in want.items():
                    assert got[token].logprob == pytest.approx(entry.logprob, abs=1e-4), rid


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine",
    [
        pytest.param({"max_num_batched_tokens": 48}, id="chunked-prefill-and-prefix-hits"),
        pytest.param({"num_kv_blocks": 20, "max_num_batched_tokens": 64}, id="preemption"),
        pytest.param({"kernels": "torch", "max_num_batched_tokens": 48}, id="torch-kernels"),
    ],
)
def test_greedy_tokens_equal_without_speculation(model_factory, monkeypatch, engine):
    reference_llm, reference, llm, speculated = compare(
        model_factory("qwen3"), monkeypatch, requests, **engine
    )
    assert_same(reference, speculated)
    stats = llm.engine.spec.stats
    k = NGRAM["num_speculative_tokens"]
    assert stats.num_drafts > 20
    assert all(count > 0 for count in stats.accepted_per_position)  # every length seen
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # and rejections
    assert 1.0 < stats.mean_accepted_length <= k + 1
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks  # no block leaked
    if "num_kv_blocks" in engine:
        assert llm.engine.scheduler.num_preemptions > 0
    else:
        assert llm.engine.blocks.prefix_hits > 0


def stop_requests(vocab: int) -> dict[int, list]:
    rng = random.Random(9)
    prompt = [rng.randrange(4, vocab) for _ in range(20)]
    return {0: [("free", prompt, SamplingParams(**GREEDY))]}


def test_stop_token_and_max_tokens_cut_accepted_tokens(model_factory, monkeypatch):
    model_dir = model_factory("qwen3")
    reference_llm = LLM(model_dir, dtype="float32", max_model_len=192)
    vocab = reference_llm.config.model.vocab_size
    free = run(reference_llm, stop_requests(vocab))["free"][0]
    prompt = stop_requests(vocab)[0][0][1]
    stop_at = next(i for i in range(6, len(free)) if free[i] not in free[:i])
    schedule = {
        0: [
            ("stop", prompt, SamplingParams(**dict(GREEDY, stop_token_ids=[free[stop_at]]))),
            ("max", [*prompt, 4], SamplingParams(**dict(GREEDY, max_tokens=9))),
        ]
    }
    reference = run(reference_llm, schedule)
    assert len(reference["stop"][0]) == stop_at + 1 and len(reference["max"][0]) == 9
    # proposals always right and as long as allowed: the cut falls inside an accepted run
    continuations = {tuple(prompt): free, (*prompt, 4): reference["max"][0] + [7] * 8}

    class AlwaysRight(OracleIndex):
        def propose(self, tokens, k):
            for start, output in self.continuations.items():
                if tuple(tokens[: len(start)]) == start:
                    done = len(tokens) - len(start)
                    return list(output[done : done + k])
            return []

    monkeypatch.setattr(spec_decode, "NgramIndex", lambda a, b: AlwaysRight(continuations, vocab))
    llm = LLM(model_dir, dtype="float32", max_model_len=192, speculative_config=NGRAM)
    assert run(llm, schedule) == reference
    assert llm.engine.spec.stats.num_accepted_tokens >= 8


def test_no_speculation_above_the_batch_size_or_while_acceptance_stays_low():
    config = SpeculativeConfig("ngram", 3, 1, 2, disable_by_batch_size=2)
    decoder = SpecDecoder(config, max_model_len=100)

    class Seq:
        seq_id = 1
        embed = False
        constraint = None
        num_output_tokens = 4
        max_tokens = 50
        num_tokens = 12
        token_ids = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3]

        class params:  # noqa: N801
            min_tokens = 0

    seq = Seq()
    assert decoder.propose(seq, num_running=2) == [1]  # a fresh n-gram match: one token
    assert decoder.propose(seq, num_running=2) == [1, 2, 3]  # where it continues: up to k
    assert decoder.propose(seq, num_running=3) == []
    for _ in range(5):  # nothing accepted, step after step
        decoder.record(seq.seq_id, 3, 0)
        if decoder.seqs[seq.seq_id].paused:
            break
    assert decoder.seqs[seq.seq_id].paused == PAUSE_STEPS
    assert decoder.take_rewind(seq.seq_id) == 3 and decoder.take_rewind(seq.seq_id) == 0
    for _ in range(PAUSE_STEPS):
        assert decoder.propose(seq, num_running=1) == []
    assert decoder.propose(seq, num_running=1) == [1, 2, 3]
    seq.max_tokens = 6  # room for one proposal and the model's own token
    assert decoder.propose(seq, num_running=1) == [1]
    stats = decoder.stats
    assert stats.num_draft_tokens == 3 * stats.num_drafts and stats.num_accepted_tokens == 0


REWRITE = (
    "The lighthouse stood on the northern cliff for nearly two hundred years. Every night its "
    "keeper climbed the spiral stairs, trimmed the wick and polished the great lens, so that "
    "ships passing the rocks would see the beam and steer clear of danger. When the keeper grew "
    "old, his granddaughter took over the work, and she kept the light burning through the "
    "worst storms the coast had ever seen."
)


@pytest.mark.slow
def test_default_model_rewrite_is_unchanged_and_mostly_accepted():
    """SmolLM2 (the default model) copying a paragraph: n-gram proposals and the draft's are
    nearly all accepted, greedy output and a stop string's cut are the same as without
    speculation."""
    messages = [
        {"role": "user", "content": f"Rewrite this paragraph, keeping every sentence:\n\n{REWRITE}"}
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=100),
        SamplingParams(temperature=0, max_tokens=100, stop=["polished"]),
        SamplingParams(temperature=0, max_tokens=60, repetition_penalty=1.1, logprobs=1),
    ]
    from cpud.model.default_model import default_model_path

    # the default model's own file as its draft: proposals it makes are the target's argmax
    draft = {"method": "draft_model", "model": str(default_model_path())}
    results, stats = [], []
    for spec in (None, NGRAM, {**draft, "num_speculative_tokens": 4}):
        llm = LLM(speculative_config=spec)
        outputs = [llm.chat(messages, p)[0].outputs[0] for p in params]
        results.append([(list(o.token_ids), o.text, o.finish_reason) for o in outputs])
        stats.append(llm.engine.spec.stats if spec else None)
        llm.shutdown()
    plain, speculated, drafted = results
    assert speculated == plain
    assert drafted == plain
    assert plain[1][2] == "stop" and plain[1][1] and "polished" not in plain[1][1]
    for method in stats[1:]:
        assert method.num_accepted_tokens > 0.7 * method.num_draft_tokens
        assert method.mean_accepted_length > 3


@pytest.mark.slow
def test_greedy_tokens_equal_without_speculation_across_two_ranks(model_factory, monkeypatch):
    """TP=2 (rank processes, the sampler on rank 0, rewinds reaching both ranks) with and
    without speculation, and against TP=1 with it."""
    model_dir = model_factory("qwen3")
    engine = {"max_num_batched_tokens": 48, "tp": 2, "bind": "0|1"}
    reference_llm, reference, llm, speculated = compare(model_dir, monkeypatch, requests, **engine)
    try:
        assert_same(reference, speculated)
        stats = llm.engine.spec.stats
        assert stats.num_drafts > 20 and all(c > 0 for c in stats.accepted_per_position)
    finally:
        llm.shutdown()
        reference_llm.shutdown()


def grammar_requests(vocab: int) -> dict[int, list]:
    from cpud.structured.spec import StructuredSpec

    rng = random.Random(4)
    prompt = [rng.randrange(4, vocab) for _ in range(15)]
    items = ' "," '.join(["ITEM"] * 10)  # the mask changes from position to position
    spec = StructuredSpec("grammar", f'start: "(" {items} ")"\nITEM: /[a-z][0-9]/')
    params = SamplingParams(temperature=0, max_tokens=40, structured=spec)
    return {0: [("grammar", prompt, params)]}


def test_grammar_requests_verify_proposals_under_their_masks(model_factory, monkeypatch):
    """A grammar-constrained request speculates: proposals the grammar refuses are cut before
    they are sent, each position is verified under its own mask, and the output is the same."""
    reference_llm, reference, llm, speculated = compare(
        model_factory("qwen3"), monkeypatch, grammar_requests
    )
    assert_same(reference, speculated)
    text = llm.tokenizer.decode(speculated["grammar"][0])
    assert re.fullmatch(r"\((?:[a-z][0-9],){9}[a-z][0-9]\)", text), text
    stats = llm.engine.spec.stats
    assert stats.num_drafts > 3 and stats.num_accepted_tokens > 3


@pytest.mark.slow
def test_seeded_sampling_is_the_same_with_speculation_whatever_the_batch(
    model_factory, monkeypatch
):
    """Each verified position draws with the seed plain decoding uses there: a seeded request
    gives the same tokens with speculation (proposals of its own plain output, some wrong) as
    without, alone or beside others."""
    model_dir = model_factory("qwen3")
    plain = LLM(model_dir, dtype="float32", max_model_len=192)
    rng = random.Random(8)
    vocab = plain.config.model.vocab_size
    prompt = [rng.randrange(4, vocab) for _ in range(12)]
    others = [[rng.randrange(4, vocab) for _ in range(9)] for _ in range(3)]
    seeded = SamplingParams(temperature=0.7, top_p=0.9, seed=21, max_tokens=30, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    want = list(plain.generate([prompt], seeded)[0].outputs[0].token_ids)
    use_oracle(monkeypatch, {tuple(prompt): want}, vocab)
    llm = LLM(model_dir, dtype="float32", max_model_len=192, speculative_config=NGRAM)
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    batched = llm.generate([*others, prompt], [other] * 3 + [seeded])[-1].outputs[0].token_ids
    assert list(alone) == want and list(batched) == want
    stats = llm.engine.spec.stats
    assert stats.num_drafts > 6 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
