"""Embedding requests in the engine: scheduled whole beside generations (never chunked), KV
blocks only for a decoder and only for their step, limits as 400-style RequestErrors, the
offline LLM.embed, and a generation's tokens unchanged by embeddings sharing its steps."""

from __future__ import annotations

import math
import random

import pytest

from cpud import LLM, SamplingParams
from cpud.engine.block_manager import BlockManager
from cpud.engine.detokenizer import IncrementalDetokenizer
from cpud.engine.embedding import shortened, truncated, vector_bytes, vector_from_bytes
from cpud.engine.outputs import OutputAccumulator, RequestOutput
from cpud.engine.scheduler import Scheduler
from cpud.engine.sequence import SeqStatus, Sequence
from cpud.protocol.step import StepResult
from cpud.settings.errors import RequestError


class NullDecoder:
    def decode(self, token_ids, skip_special_tokens=True):
        return ""


def make_seq(seq_id: int, length: int, embed: bool = False) -> Sequence:
    tokens = list(range(10, 10 + length))
    detok = IncrementalDetokenizer(NullDecoder())
    return Sequence(seq_id, str(seq_id), 0, tokens, SamplingParams(), detok, None, embed=embed)


def run_step(scheduler: Scheduler) -> list[tuple[int, int]]:
    """One step as the engine runs it: generations sample a token, embeddings finish."""
    out = scheduler.schedule()
    for item in out.scheduled:
        seq = item.seq
        seq.num_computed_tokens += item.num_tokens
        if seq.embed:
            scheduler.finish(seq)
        elif seq.num_uncomputed == 0:
            seq.token_ids.append(1)
    return [(item.seq.seq_id, item.num_tokens) for item in out.scheduled]


def test_an_embedding_runs_whole_beside_decodes_and_a_prefill_chunk():
    scheduler = Scheduler(BlockManager(100, 16, False), max_num_seqs=8, max_batched_tokens=32)
    scheduler.add(make_seq(0, 4))
    assert run_step(scheduler) == [(0, 4)]
    scheduler.add(make_seq(1, 40))  # a long prompt: chunked
    scheduler.add(make_seq(2, 20, embed=True))
    assert run_step(scheduler) == [(0, 1), (1, 31)]  # no room for 20 tokens: it waits
    # It waited at the head: the prefill chunk leaves it its whole prompt this step.
    assert run_step(scheduler) == [(0, 1), (1, 9), (2, 20)]
    assert not scheduler.waiting and [s.seq_id for s in scheduler.running] == [0, 1]


def test_an_embedding_that_waited_goes_first_even_when_decodes_fill_the_budget():
    scheduler = Scheduler(BlockManager(100, 16, False), max_num_seqs=64, max_batched_tokens=32)
    for i in range(30):
        scheduler.add(make_seq(i, 1))
    run_step(scheduler)  # 30 one-token prompts, now decoding
    scheduler.add(make_seq(99, 20, embed=True))
    assert len(run_step(scheduler)) == 30  # 30 decodes: 2 tokens left, the embedding waits
    second = run_step(scheduler)
    assert (99, 20) in second and len(second) == 13  # 12 decodes and the embedding
    assert len(run_step(scheduler)) == 30


def test_embeddings_are_admitted_in_arrival_order_and_never_chunked():
    scheduler = Scheduler(BlockManager(100, 16, False), max_num_seqs=8, max_batched_tokens=32)
    scheduler.add(make_seq(0, 20, embed=True))
    scheduler.add(make_seq(1, 20, embed=True))
    scheduler.add(make_seq(2, 5))
    assert run_step(scheduler) == [(0, 20)]  # the next one waits, and the request behind it
    assert run_step(scheduler) == [(1, 20), (2, 5)]


def test_a_decoder_embedding_takes_blocks_for_its_step_only_and_skips_the_prefix_cache():
    blocks = BlockManager(10, 16, True)
    scheduler = Scheduler(blocks, max_num_seqs=8, max_batched_tokens=64)
    embed = make_seq(0, 40, embed=True)
    scheduler.add(embed)
    out = scheduler.schedule()
    assert [(i.seq, i.num_tokens) for i in out.scheduled] == [(embed, 40)]
    assert len(embed.blocks.block_ids) == 3 and blocks.num_free == 7
    scheduler.finish(embed)
    assert blocks.num_free == 10 and blocks.cached == {}
    # A cached prefix is not used: every position is computed for pooling.
    gen = make_seq(1, 40)
    scheduler.add(gen)
    run_step(scheduler)
    blocks.cache_computed(gen.blocks, gen.token_ids, gen.num_computed_tokens)
    again = make_seq(2, 40, embed=True)
    scheduler.add(again)
    assert run_step(scheduler)[-1] == (2, 40) and again.num_cached_tokens == 0


def test_an_encoder_embedding_takes_no_blocks():
    blocks = BlockManager(1, 16, False)
    scheduler = Scheduler(blocks, max_num_seqs=8, max_batched_tokens=64, embeddings_use_kv=False)
    seqs = [make_seq(i, 30, embed=True) for i in range(2)]
    for seq in seqs:
        scheduler.add(seq)
    assert run_step(scheduler) == [(0, 30), (1, 30)]
    assert blocks.num_free == 1 and all(s.status is SeqStatus.FINISHED for s in seqs)


def test_vectors_round_trip_and_shorten():
    vector = [0.6, 0.8, 0.0, 0.0]
    assert vector_from_bytes(vector_bytes(vector)) == pytest.approx(vector)
    assert shortened(vector, 1, True) == [1.0]
    assert shortened(vector, 1, False) == pytest.approx([0.6])
    assert shortened(vector, None, True) == vector and shortened(vector, 4, True) == vector
    assert truncated([1, 2, 3], 2, 10) == [2, 3] and truncated([1, 2, 3], -1, 2) == [2, 3]
    with pytest.raises(RequestError, match="truncate_prompt_tokens"):
        truncated([1, 2], 0, 10)


@pytest.fixture(scope="module")
def llm(model_factory):
    return LLM(
        model_factory("qwen3"), dtype="float32", max_model_len=256, max_num_batched_tokens=64
    )


def norm(vector: list[float]) -> float:
    return math.sqrt(sum(v * v for v in vector))


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b)) / (norm(a) * norm(b))


def test_llm_embed_returns_vllm_shaped_outputs_and_frees_its_blocks(llm):
    free = llm.engine.blocks.num_free
    outs = llm.embed(["hello world", [11, 12, 13]])
    hidden = llm.config.model.hidden_size
    assert [o.prompt_token_ids for o in outs][1] == [11, 12, 13]
    assert outs[0].prompt_token_ids == llm.tokenizer.encode("hello world")
    for out in outs:
        assert out.finished and len(out.outputs.embedding) == out.outputs.hidden_size == hidden
        assert all(isinstance(v, float) for v in out.outputs.embedding)
        assert norm(out.outputs.embedding) == pytest.approx(1.0, abs=1e-5)  # last token, normed
    assert llm.engine.blocks.num_free == free and not llm.engine.has_unfinished()
    short = llm.embed([11, 12, 13], dimensions=8)[0].outputs.embedding
    assert len(short) == 8 and norm(short) == pytest.approx(1.0, abs=1e-6)
    assert cosine(short, outs[1].outputs.embedding[:8]) == pytest.approx(1.0, abs=1e-6)
    last = llm.embed([9, 9, 9, 11, 12, 13], truncate_prompt_tokens=3)[0]
    assert last.prompt_token_ids == [11, 12, 13]


def test_embedding_limits_are_request_errors(llm):
    with pytest.raises(RequestError, match="max-num-batched-tokens"):
        llm.embed([[11] * 65])
    with pytest.raises(RequestError, match="empty"):
        llm.embed([[]])
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed("hi", dimensions=llm.config.model.hidden_size + 1)


def test_embeddings_beside_generations_leave_their_tokens_unchanged(llm):
    rng = random.Random(5)
    vocab = llm.config.model.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(n)] for n in (5, 90, 12)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    inputs = [[rng.randrange(10, vocab) for _ in range(rng.randrange(3, 40))] for _ in range(24)]
    vectors_alone = [o.outputs.embedding for o in llm.embed(inputs)]
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"g{i}", prompt, params)
    finals = {}
    folds: dict[str, OutputAccumulator] = {}
    for step in range(200):
        if step == 2:  # generations decoding, the long prompt still in its chunks
            for i, tokens in enumerate(inputs):
                engine.admit(f"e{i}", engine.validate_embedding(tokens))
        for out in engine.step():
            if isinstance(out, RequestOutput):
                folds.setdefault(out.request_id, OutputAccumulator()).add(out)
                out = folds[out.request_id].result() if out.finished else out
            if out.finished:
                finals[out.request_id] = out
        if not engine.has_unfinished():
            break
    assert [finals[f"g{i}"].outputs[0].token_ids for i in range(3)] == alone
    for i, vector in enumerate(vectors_alone):
        assert cosine(finals[f"e{i}"].outputs.embedding, vector) > 0.99999


class DroppingExecutor:
    """The real executor, but the ranks' embeddings go missing."""

    def __init__(self, inner):
        self.inner = inner

    def execute(self, plan):
        result = self.inner.execute(plan)
        return StepResult(result.step_id, result.tokens, result.forward_seconds)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_an_embedding_the_ranks_do_not_return_fails_its_request_only(llm):
    engine = llm.engine
    inner = engine.executor
    engine.executor = DroppingExecutor(inner)
    engine.isolate_requests = True
    try:
        engine.admit("lost", engine.validate_embedding([11, 12]))
        engine.add_request("gen", [11, 12], SamplingParams(max_tokens=2, ignore_eos=True))
        finished = []
        while engine.has_unfinished():
            finished += [o.request_id for o in engine.step() if o.finished]
        failures = engine.take_failures()
    finally:
        engine.executor = inner
        engine.isolate_requests = False
    assert finished == ["gen"]
    assert [(rid, "reading its embedding" in str(exc)) for rid, exc in failures] == [("lost", True)]
    assert engine.blocks.num_free == engine.blocks.num_blocks
