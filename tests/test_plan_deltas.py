"""Plans are deltas: a sequence's settings and history reach the ranks once, a decode step
carries only new tokens and blocks, and the ranks' per-sequence state stays right across
preemption, abort, prefix hits and penalties (the same tokens as plans that resend every
sequence whole each step)."""

from __future__ import annotations

import random

import pytest
from stub_engine import stub_engine

from cpud import LLM, SamplingParams
from cpud.engine.outputs import OutputAccumulator

PENALTIES = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4)


@pytest.fixture(scope="module")
def base(model_factory):
    llm = LLM(model_factory("qwen3"), dtype="float32", max_model_len=256)
    return llm.config, llm.tokenizer


@pytest.mark.parametrize("params", [{}, PENALTIES, {"logprobs": 3, "seed": 5, "temperature": 1.0}])
def test_decode_step_sends_the_same_bytes_at_5000_tokens_as_at_100(base, params):
    config, tokenizer = base
    engine, stub = stub_engine(config, tokenizer, "a", 5200, 1)
    prompt = tokenizer.encode("Tell me a long story")
    engine.add_request("long", prompt, SamplingParams(max_tokens=5100, ignore_eos=True, **params))
    while engine.has_unfinished():
        engine.step()
    # Step k decodes output token k + 1; one step in 16 also sends its sequence's new block.
    early, late = min(stub.plan_bytes[95:112]), min(stub.plan_bytes[4995:5012])
    assert late - early <= 2, f"a decode step sends {early} bytes at 100 tokens, {late} at 5000"
    assert stub.plan_bytes[0] > early  # the first step carries the prompt and the settings


def run_requests(llm: LLM, schedule: dict[int, list], resend: bool, abort: tuple[str, int]):
    """Admit each request at its step, abort one at its step, run to the end; token ids per
    request. resend: every sequence goes to the ranks whole each step (as the previous,
    stateless plans did)."""
    engine = llm.engine
    if resend:
        planner = engine.planner
        sent = planner.sent

        def forget_all(plan, live):
            sent(plan, live)
            for seq in engine.seqs.values():
                if seq.on_ranks:
                    seq.on_ranks, seq.blocks_on_ranks = False, 0
                    planner.to_drop.add(seq.seq_id)

        planner.sent = forget_all
    folds: dict[str, OutputAccumulator] = {}
    step = 0
    while step <= max(schedule) or engine.has_unfinished():
        for request_id, prompt, params in schedule.get(step, []):
            engine.add_request(request_id, prompt, params)
        if step == abort[1]:
            engine.abort(abort[0])
        for out in engine.step():
            folds.setdefault(out.request_id, OutputAccumulator()).add(out)
        step += 1
    held = set(engine.executor.runner.seqs.held)
    assert held == engine.planner.to_drop  # the ranks hold nothing but what the next step drops
    return {rid: [list(o.token_ids) for o in f.result().outputs] for rid, f in folds.items()}


def schedule(vocab: int) -> dict[int, list]:
    rng = random.Random(11)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(4, vocab) for _ in range(n)]

    shared = prompt(40)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return {
        0: [
            ("penalised", prompt(37), SamplingParams(**greedy_args(), **PENALTIES)),
            ("first", [*shared, 5], greedy),
            ("aborted", prompt(20), SamplingParams(**greedy_args(), frequency_penalty=0.7)),
        ],
        4: [
            ("prefix hit", [*shared, 9, 10], SamplingParams(**greedy_args(), **PENALTIES)),
            (
                "seeded",
                prompt(33),
                SamplingParams(temperature=0.9, seed=3, max_tokens=24, ignore_eos=True, n=2),
            ),
        ],
    }


def greedy_args() -> dict:
    return {"temperature": 0, "max_tokens": 24, "ignore_eos": True}


@pytest.mark.slow
@pytest.mark.parametrize("num_kv_blocks", [64, 12])
def test_ranks_keep_sequences_right_as_plain_resending_would(model_factory, num_kv_blocks):
    """64 blocks: prefix hits, no preemption; 12: preemption (every request needs 4-5)."""
    model_dir = model_factory("qwen3")
    results, engines = [], []
    for resend in (False, True):
        llm = LLM(model_dir, dtype="float32", num_kv_blocks=num_kv_blocks, max_model_len=192)
        results.append(
            run_requests(llm, schedule(llm.config.model.vocab_size), resend, ("aborted", 3))
        )
        engines.append(llm.engine)
    deltas, whole = results
    assert deltas == whole
    assert len(deltas["aborted"][0]) < 24 and all(
        len(tokens) == 24 for rid, out in deltas.items() if rid != "aborted" for tokens in out
    )
    engine = engines[0]
    if num_kv_blocks == 12:
        assert engine.scheduler.num_preemptions > 0
    else:
        assert engine.blocks.prefix_hits > 0
