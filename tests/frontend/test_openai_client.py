"""The official openai client against a real cpud server."""

from __future__ import annotations

import pytest

MODEL = "tiny"


def test_models_lists_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_greedy_with_usage(client):
    out = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=8, temperature=0)
    choice = out.choices[0]
    assert out.object == "text_completion" and out.model == MODEL
    assert choice.finish_reason in ("length", "stop")
    assert out.usage.completion_tokens <= 8 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    again = client.completions.create(
        model=MODEL, prompt="Hello world", max_tokens=8, temperature=0
    )
    assert again.choices[0].text == choice.text


def test_completion_prompt_forms_and_n(client):
    out = client.completions.create(
        model=MODEL, prompt=["one", "two"], max_tokens=4, n=2, temperature=1.0, seed=3
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 4


def test_seed_reproducibility(client):
    kwargs = dict(model=MODEL, prompt="Seeded", max_tokens=12, temperature=1.0, seed=1234)
    a = client.completions.create(**kwargs).choices[0].text
    b = client.completions.create(**kwargs).choices[0].text
    assert a == b
    c = client.completions.create(**{**kwargs, "seed": 99}).choices[0].text
    assert c != a


def test_stop_string_is_not_returned(client):
    base = (
        client.completions.create(
            model=MODEL,
            prompt="Stop test",
            max_tokens=30,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    assert len(base) > 10
    stop = base[5:8]
    out = client.completions.create(
        model=MODEL, prompt="Stop test", max_tokens=30, temperature=0, stop=[stop]
    ).choices[0]
    assert out.text == base[: base.index(stop)] and out.finish_reason == "stop"


def test_streaming_completion_matches_non_streaming(client):
    kwargs = dict(model=MODEL, prompt="Stream me", max_tokens=10, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 10
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [chunks[-2].choices[0].finish_reason]


def test_chat_completion_and_stream(client):
    messages = [{"role": "user", "content": "Say something"}]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0
    )
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content


def test_chat_max_completion_tokens_and_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 4 == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy = top 1


def test_completion_logprobs(client):
    out = client.completions.create(
        model=MODEL,
        prompt="abc",
        max_tokens=3,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(v <= 0 for v in lp.token_logprobs)


def test_metrics_cover_requests_latency_and_the_rank(client, server):
    import httpx

    client.completions.create(model=MODEL, prompt="metrics", max_tokens=3, temperature=0)
    text = httpx.get(server.base_url + "/metrics").text
    for name in (
        'cpud_requests_total{endpoint="/v1/completions",status="200"}',
        "cpud_time_to_first_token_seconds_bucket",
        "cpud_inter_token_latency_seconds_bucket",
        "cpud_e2e_request_latency_seconds_count",
        "cpud_kv_cache_usage_ratio",
        "cpud_prefix_cache_hits_total",
        "cpud_preemptions_total",
        # `cpud serve` runs even one rank in its own process, bound to the node of its CPUs.
        'cpud_rank_steps_total{numa_node="0",rank="0"}',
        'cpud_rank_resident_bytes{numa_node="0",rank="0"}',
    ):
        assert name in text, name


def test_stream_events_are_ascii_json_lines(server):
    import httpx

    body = {"prompt": "héllo", "max_tokens": 24, "stream": True, "seed": 3}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body) as response:
        raw = response.read()
    assert raw.isascii()  # no raw U+2028 / U+0085 that splitlines() would break on
    lines = [line for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(raw.decode().splitlines()) == len(
        raw.decode().split("\n")
    ) - (1 if raw.decode().endswith("\n") else 0)


def sampled(**fields) -> dict:
    """A seeded request at temperature 1 that never stops early: over non-ASCII text, some
    steps' tokens hold their text back (partial UTF-8, or no text at all)."""
    return dict(
        model=MODEL, max_tokens=32, temperature=1.0, extra_body={"ignore_eos": True}, **fields
    )


@pytest.mark.parametrize("seed,stop", [(1, None), (2, None), (3, ["zzzz"]), (5, ["zzzz"])])
def test_streamed_logprobs_equal_the_full_response(client, seed, stop):
    # Held-back tokens (also held for a possible stop string) stream their logprobs with the
    # next chunk, and the offsets count every token's own text, as the full response does.
    kwargs = sampled(prompt="héllo wörld", seed=seed, logprobs=1, stop=stop)
    full = client.completions.create(**kwargs).choices[0]
    chunks = [c for c in client.completions.create(**kwargs, stream=True) if c.choices]
    parts = [c.choices[0].logprobs for c in chunks]
    assert [t for p in parts for t in p.tokens] == full.logprobs.tokens
    assert [o for p in parts for o in p.text_offset] == full.logprobs.text_offset
    assert len(full.logprobs.tokens) == 32
    assert "".join(c.choices[0].text for c in chunks) == full.text


def test_streamed_chat_logprobs_cover_every_token(client):
    kwargs = sampled(messages=[{"role": "user", "content": "héllo"}], seed=1, logprobs=True)
    full = client.chat.completions.create(**kwargs).choices[0]
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    tokens = [e.token for c in chunks for e in c.choices[0].logprobs.content]
    assert tokens == [e.token for e in full.logprobs.content] and len(tokens) == 32
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.message.content


def test_chat_template_kwargs_override_add_generation_prompt(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    with_header = client.chat.completions.create(**kwargs).usage.prompt_tokens
    without = client.chat.completions.create(
        **kwargs, extra_body={"chat_template_kwargs": {"add_generation_prompt": False}}
    ).usage.prompt_tokens
    assert without < with_header


@pytest.mark.parametrize("logprobs", [0, 3])
def test_completion_top_logprobs_include_the_sampled_token(client, logprobs):
    out = client.completions.create(**sampled(prompt="héllo wörld", seed=1, logprobs=logprobs))
    lp = out.choices[0].logprobs
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # tokens that decode alike (partial UTF-8 shows as U+FFFD) share one key
        assert token in top and len(top) <= logprobs + 1
        if logprobs == 0:
            assert top == {token: value}


def test_echo_of_token_ids_keeps_special_tokens(client, server):
    import httpx

    ids = httpx.post(server.base_url + "/tokenize", json={"prompt": "<|im_start|>user hi"}).json()
    ids = ids["tokens"]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True)
    assert out.choices[0].text.startswith("<|im_start|>user hi")
