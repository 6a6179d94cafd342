"""Sampling semantics: the sampler alone on crafted logits, then through the engine."""

from __future__ import annotations

import math

import pytest
import torch

from cpud import LLM, SamplingParams
from cpud.engine.detokenizer import IncrementalDetokenizer
from cpud.engine.step_planner import sampling_spec
from cpud.ranks.penalty_counts import PenaltyCounts
from cpud.ranks.sampler import SamplingRow, sample
from cpud.settings.errors import RequestError
from cpud.text.tokenizer import Tokenizer

VOCAB = 50


def work(params: SamplingParams, seed=None, banned=(), prompt=(), output=()) -> SamplingRow:
    counts = PenaltyCounts.of(prompt, output) if params.needs_penalties else None
    return SamplingRow(0, sampling_spec(params), seed, list(banned), counts)


def draws(logits: torch.Tensor, params: SamplingParams, count: int = 400) -> set[int]:
    generator = torch.Generator().manual_seed(0)
    rows = logits.repeat(count, 1)
    tokens = sample(rows, [work(params)] * count, generator)
    return {t.token_id for t in tokens}


def spread_logits() -> torch.Tensor:
    return torch.linspace(3.0, -3.0, VOCAB).unsqueeze(0)  # token 0 most likely


def test_greedy_is_argmax_and_banned_tokens_are_never_chosen():
    logits = spread_logits()
    assert draws(logits, SamplingParams(temperature=0), 3) == {0}
    generator = torch.Generator()
    banned = sample(logits, [work(SamplingParams(temperature=0), banned=[0, 1])], generator)
    assert banned[0].token_id == 2


def test_plain_greedy_rows_take_the_runners_argmax():
    from cpud.ranks.ops import make_ops

    logits = torch.randn(4, 999).bfloat16()
    works = [work(SamplingParams(temperature=0))] * 4
    calls = []

    def argmax(rows: torch.Tensor) -> torch.Tensor:
        calls.append(rows.shape)
        return make_ops("auto").argmax(rows)

    tokens = [t.token_id for t in sample(logits, works, torch.Generator(), argmax)]
    assert tokens == logits.float().argmax(dim=-1).tolist() and calls == [(4, 999)]
    penalised = [work(SamplingParams(temperature=0, repetition_penalty=1.5), output=[0])]
    sample(logits[:1], penalised, torch.Generator(), argmax)  # processed rows: torch's argmax
    assert calls == [(4, 999)]


def test_top_k_restricts_support():
    assert draws(spread_logits(), SamplingParams(temperature=5.0, top_k=3)) == {0, 1, 2}


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]])
    assert draws(logits, SamplingParams(temperature=1.0, top_p=0.75)) == {0, 1}
    assert draws(logits, SamplingParams(temperature=1.0, top_p=0.45)) == {0}
    assert draws(logits, SamplingParams(temperature=1.0, top_p=1.0)) == {0, 1, 2, 3}


def test_min_p_drops_tokens_below_fraction_of_best():
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]])
    # 0.15 / 0.5 = 0.3 >= 0.25 stays; 0.05 / 0.5 = 0.1 goes.
    assert draws(logits, SamplingParams(temperature=1.0, min_p=0.25)) == {0, 1, 2}


def test_same_seed_same_token_regardless_of_batch():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0)
    alone = sample(logits, [work(params, seed=1234)], torch.Generator().manual_seed(0))
    noise = torch.randn(3, VOCAB)
    batch = torch.cat([noise[:2], logits, noise[2:]])
    works = [work(params), work(params), work(params, seed=1234), work(params)]
    mixed = sample(batch, works, torch.Generator().manual_seed(99))
    assert mixed[2].token_id == alone[0].token_id
    seen = {
        sample(logits, [work(params, seed=s)], torch.Generator())[0].token_id for s in range(40)
    }
    assert len(seen) > 3, "different seeds should explore different tokens"


def test_repetition_penalty_divides_positive_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 1.9, 0.0]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    # Token 0 (2.0 -> 1.0) falls below token 2 (1.9); token 1 (-2 -> -4) stays low.
    out = sample(logits.clone(), [work(params, prompt=[0, 1])], torch.Generator())
    assert out[0].token_id == 2


def test_presence_and_frequency_penalties_use_output_counts():
    logits = torch.tensor([[3.0, 2.5, 2.4]])
    freq = SamplingParams(temperature=0, frequency_penalty=0.3)
    # token 0 appeared twice: 3.0 - 0.6 = 2.4 < 2.5
    assert sample(logits, [work(freq, output=[0, 0])], torch.Generator())[0].token_id == 1
    # once: 3.0 - 0.3 = 2.7 > 2.5
    assert sample(logits, [work(freq, output=[0])], torch.Generator())[0].token_id == 0
    pres = SamplingParams(temperature=0, presence_penalty=0.7)
    out = sample(logits, [work(pres, output=[0, 0, 0, 1])], torch.Generator())
    assert out[0].token_id == 2  # 2.3, 1.8, 2.4
    # The prompt does not count for presence/frequency.
    out = sample(logits, [work(pres, prompt=[0, 0])], torch.Generator())
    assert out[0].token_id == 0


def test_logprobs_are_raw_and_ranked():
    logits = spread_logits()
    params = SamplingParams(temperature=0, logprobs=3)
    token = sample(logits, [work(params)], torch.Generator())[0]
    expected = logits.log_softmax(-1)[0]
    assert token.rank == 1 and token.top_token_ids == [0, 1, 2]
    assert token.logprob == pytest.approx(float(expected[0]), abs=1e-6)
    assert token.top_logprobs == pytest.approx(expected[:3].tolist(), abs=1e-6)


def test_more_logprobs_than_the_vocabulary_lists_the_whole_vocabulary():
    logits = torch.linspace(1.0, -1.0, 5).unsqueeze(0)
    token = sample(logits, [work(SamplingParams(temperature=0, logprobs=20))], torch.Generator())[0]
    assert token.top_token_ids == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1},
        {"temperature": float("nan")},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"min_p": 2},
        {"max_tokens": 0},
        {"min_tokens": 5, "max_tokens": 2},
        {"logprobs": 21},
        {"n": 0},
        {"stop": [""]},
        {"presence_penalty": 3},
    ],
)
def test_invalid_params_name_the_field(kwargs):
    with pytest.raises(RequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == next(iter(kwargs)) or info.value.param in kwargs
    assert "\n" not in str(info.value)


# ---- through the engine -------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(model_factory):
    return LLM(model_factory("qwen3"), dtype="float32")


PROMPT = "The quick brown fox"


def test_seeded_requests_reproduce(llm):
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=20, ignore_eos=True)
    first = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    # Same seed inside a busier batch, next to unseeded requests.
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate(["other prompt", PROMPT, "x"], [others, params, others])
    assert batch[1].outputs[0].token_ids == first
    different = SamplingParams(temperature=1.0, seed=43, max_tokens=20, ignore_eos=True)
    assert llm.generate([PROMPT], different)[0].outputs[0].token_ids != first


def test_n_choices_are_distinct_and_seeded(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    a = llm.generate([PROMPT], params)[0]
    b = llm.generate([PROMPT], params)[0]
    assert [o.index for o in a.outputs] == [0, 1, 2, 3]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1


def test_repetition_penalty_reduces_repeats(llm):
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = llm.generate([PROMPT], base)[0].outputs[0].token_ids
    penalized = (
        llm.generate(
            [PROMPT],
            SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=5.0),
        )[0]
        .outputs[0]
        .token_ids
    )
    assert len(set(penalized)) > len(set(plain))


def test_stop_strings_cut_text_and_never_leak(llm):
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm.generate([PROMPT], base)[0].outputs[0]
    text = full.text
    assert len(text) > 12
    stop = text[8:11]
    cut = text.index(stop)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, stop=[stop]))[0]
    done = out.outputs[0]
    assert done.text == text[:cut]
    assert done.finish_reason == "stop" and done.stop_reason == stop
    assert len(done.token_ids) < len(full.token_ids)
    kept = llm.generate(
        [PROMPT],
        SamplingParams(temperature=0, max_tokens=40, stop=[stop], include_stop_str_in_output=True),
    )[0].outputs[0]
    assert kept.text == text[: cut + len(stop)]


def test_stop_token_ids_and_min_tokens(llm):
    base = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    tokens = llm.generate([PROMPT], base)[0].outputs[0].token_ids
    first = tokens[0]
    stopped = llm.generate([PROMPT], SamplingParams(temperature=0, stop_token_ids=[first]))[0]
    assert stopped.outputs[0].token_ids == [first]
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].stop_reason == first
    assert stopped.outputs[0].text == ""
    # include_stop_str_in_output keeps a stop token's text as it keeps a stop string's
    kept = llm.generate(
        [PROMPT],
        SamplingParams(temperature=0, stop_token_ids=[first], include_stop_str_in_output=True),
    )[0].outputs[0]
    assert kept.token_ids == [first] and kept.text == llm.tokenizer.decode([first]) != ""
    held = llm.generate(
        [PROMPT], SamplingParams(temperature=0, stop_token_ids=[first], min_tokens=3)
    )[0].outputs[0]
    assert first not in held.token_ids[:3]
    assert len(held.token_ids) >= 3


def test_max_tokens_and_logprobs(llm):
    out = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=2)
    )[0].outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    assert len(out.logprobs) == 7
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and entry[token].rank == 1
        assert len(entry) <= 3
    assert out.cumulative_logprob == pytest.approx(
        sum(entry[t].logprob for t, entry in zip(out.token_ids, out.logprobs))
    )


# ---- detokenizer: multi-byte characters and stop strings -----------------------------------

MULTIBYTE = "naïve café 你好世界 😀🎉 Ωμέγα ok"


@pytest.fixture(scope="module")
def tokenizer(model_factory):
    return Tokenizer(model_factory("qwen3"))


def test_incremental_text_never_holds_half_a_character(tokenizer):
    ids = tokenizer.encode(MULTIBYTE)
    # Byte-level BPE on a small corpus must split some characters over several tokens.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    detok = IncrementalDetokenizer(tokenizer)
    for token in ids:
        detok.add(token)
        assert "\ufffd" not in detok.text
        assert MULTIBYTE.startswith(detok.text)
    assert detok.text == MULTIBYTE


@pytest.mark.parametrize("stop", ["你好", "😀", "é", "Ωμ", "ok"])
def test_multibyte_stop_strings_cut_on_character_boundaries(tokenizer, stop):
    ids = tokenizer.encode(MULTIBYTE)
    detok = IncrementalDetokenizer(tokenizer, stop=(stop,))
    visible = []
    for token in ids:
        found = detok.add(token)
        visible.append(detok.text[: detok.stable_length(finished=found is not None)])
        if found:
            break
    assert found == stop
    assert detok.text == MULTIBYTE[: MULTIBYTE.index(stop)]
    # What a stream would have shown at any moment never contains any part of the stop string
    # beyond the final text.
    assert all(detok.text.startswith(shown) for shown in visible)


@pytest.mark.parametrize("vocab", [50, 3000, 151936])
def test_nucleus_from_candidates_equals_a_full_sort(vocab):
    from cpud.ranks.sampler import keep_nucleus, keep_nucleus_sorted

    gen = torch.Generator().manual_seed(vocab)
    for scale in (0.3, 2.0, 8.0):  # flat (the set runs past the candidates) to peaked
        logits = torch.randn(7, vocab, generator=gen) * scale
        top_k = torch.tensor([vocab, 1, 5, 40, 2000, vocab, vocab]).clamp(max=vocab)
        top_p = torch.tensor([1.0, 0.9, 0.5, 0.99, 1.0, 0.3, 0.95])
        fast = keep_nucleus(logits, top_k, top_p)
        ref = keep_nucleus_sorted(logits, top_k, top_p)
        assert torch.equal(fast.isinf(), ref.isinf()), (fast.isinf() != ref.isinf()).sum(1)
        assert torch.equal(fast[~fast.isinf()], ref[~ref.isinf()])
        assert not fast[0].isinf().any()  # top_k = vocab and top_p = 1 restrict nothing
        assert int((~fast[1].isinf()).sum()) == 1


def test_draw_follows_the_probabilities():
    """Inverse-CDF draws over a vocabulary that is not a whole number of CDF blocks: zero
    probabilities are never drawn, frequencies match within 5 sigma, and all mass on the first
    or the last token always draws it."""
    from cpud.ranks.sampler import CDF_BLOCK, draw

    vocab = 2 * CDF_BLOCK + 77
    probs = torch.zeros(vocab)
    chosen = torch.tensor([0, 3, CDF_BLOCK - 1, CDF_BLOCK, 2 * CDF_BLOCK + 5, vocab - 1])
    probs[chosen] = torch.tensor([0.3, 0.05, 0.2, 0.15, 0.1, 0.2])
    count = 20000
    rows = probs.repeat(count, 1) * 3.0  # need not sum to 1
    tokens = draw(rows, [work(SamplingParams(temperature=1.0))] * count, torch.Generator())
    seen = torch.bincount(tokens, minlength=vocab).double()
    assert float(seen[probs == 0].sum()) == 0
    expected = probs.double() * count
    sigma = (expected * (1 - probs.double())).sqrt()
    assert bool(((seen - expected).abs()[chosen] <= 5 * sigma[chosen] + 1).all()), seen[chosen]
    for token in (0, vocab - 1):
        one = torch.zeros(4, vocab)
        one[:, token] = 1.0
        got = draw(one, [work(SamplingParams(temperature=1.0))] * 4, torch.Generator())
        assert got.tolist() == [token] * 4


@pytest.mark.parametrize("fill", [float("-inf"), float("nan")])
def test_rows_without_probability_mass_still_give_a_vocabulary_token(fill):
    """Logits all -inf or NaN (a fuzzed request found the first): a token inside the vocabulary,
    never an index past it that the next step's embedding would fail on."""
    vocab = 300  # not a whole number of CDF blocks
    params = SamplingParams(temperature=0.9)
    token = sample(torch.full((1, vocab), fill), [work(params)], torch.Generator())[0].token_id
    assert 0 <= token < vocab
    if fill == float("-inf"):  # one finite logit left: it is the token (NaN poisons a row)
        one_left = torch.full((1, vocab), fill)
        one_left[0, 7] = 0.0
        assert sample(one_left, [work(params)], torch.Generator())[0].token_id == 7
