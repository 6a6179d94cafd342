"""/v1/embeddings as clients call it: the openai SDK (strings, lists, token ids, its default
base64, dimensions), LangChain's OpenAIEmbeddings, raw HTTP errors, a 64-input batch sent
while streaming generations run (their tokens unchanged), metrics and access lines; and a
generation route on an encoder-only model answered with a 400."""

from __future__ import annotations

import base64
import math
import struct
import threading
import time

import httpx
import pytest

from cpud_server_helpers import metric, start_server

MAX_BATCHED = 128
MAX_LEN = 512


@pytest.fixture(scope="module")
def server(model_factory, tmp_path_factory):
    srv = start_server(
        model_factory("qwen3"),
        tmp_path_factory.mktemp("embed") / "serve.log",
        "--max-model-len",
        str(MAX_LEN),
        "--max-num-batched-tokens",
        str(MAX_BATCHED),
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hidden_size(server) -> int:
    body = {"model": "tiny", "input": "size", "encoding_format": "float"}
    return len(post(server, body).json()["data"][0]["embedding"])


def post(server, body: dict, path: str = "/v1/embeddings") -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=120)


def norm(vector) -> float:
    return math.sqrt(sum(v * v for v in vector))


def cosine(a, b) -> float:
    return sum(x * y for x, y in zip(a, b)) / (norm(a) * norm(b))


def test_sdk_string_default_base64_equals_float(client, server):
    by_sdk = client.embeddings.create(model="tiny", input="The quick brown fox")
    raw = post(server, {"model": "tiny", "input": "The quick brown fox"}).json()
    floats = raw["data"][0]["embedding"]
    assert by_sdk.object == "list" and by_sdk.model == "tiny"
    assert by_sdk.data[0].embedding == floats  # float32 either way, bit for bit
    assert norm(floats) == pytest.approx(1.0, abs=1e-5)  # decoder: last token, normalised
    tokens = len(
        httpx.post(server.base_url + "/tokenize", json={"prompt": "The quick brown fox"}).json()[
            "tokens"
        ]
    )
    assert by_sdk.usage.prompt_tokens == by_sdk.usage.total_tokens == tokens
    as_base64 = {"model": "tiny", "input": "The quick brown fox", "encoding_format": "base64"}
    packed = base64.b64decode(post(server, as_base64).json()["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(floats)}f", packed)) == floats


def test_sdk_list_of_strings_and_token_ids(client):
    texts = ["alpha", "a somewhat longer second input", "3"]
    batch = client.embeddings.create(model="tiny", input=texts, encoding_format="float")
    assert [d.index for d in batch.data] == [0, 1, 2]
    for text, item in zip(texts, batch.data):
        alone = client.embeddings.create(model="tiny", input=text).data[0].embedding
        assert cosine(item.embedding, alone) > 0.99999
    ids = client.embeddings.create(model="tiny", input=[11, 12, 13])
    lists = client.embeddings.create(model="tiny", input=[[11, 12, 13], [14, 15]])
    assert len(ids.data) == 1 and len(lists.data) == 2 and lists.usage.prompt_tokens == 5
    assert cosine(ids.data[0].embedding, lists.data[0].embedding) > 0.99999
    assert cosine(lists.data[0].embedding, lists.data[1].embedding) < 0.9999


def test_sdk_dimensions_truncate_and_renormalise(client, hidden_size):
    full = client.embeddings.create(model="tiny", input="matryoshka").data[0].embedding
    short = client.embeddings.create(model="tiny", input="matryoshka", dimensions=16)
    vector = short.data[0].embedding
    assert len(vector) == 16 and norm(vector) == pytest.approx(1.0, abs=1e-6)
    scale = norm(full[:16])
    assert vector == pytest.approx([v / scale for v in full[:16]], abs=1e-6)
    same = client.embeddings.create(model="tiny", input="matryoshka", dimensions=hidden_size)
    assert same.data[0].embedding == full


def test_langchain_openai_embeddings(server, client):
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(
        model="tiny",
        base_url=server.base_url + "/v1",
        api_key="unused",
        check_embedding_ctx_length=False,  # it would tokenize with tiktoken's vocabulary
        max_retries=0,
    )
    docs = embeddings.embed_documents(["first document", "second document"])
    query = embeddings.embed_query("first document")
    assert len(docs) == 2 and len(query) == len(docs[0])
    assert cosine(query, docs[0]) > 0.99999 and cosine(query, docs[1]) < 0.9999
    direct = client.embeddings.create(model="tiny", input="first document").data[0].embedding
    assert cosine(query, direct) > 0.99999


def error(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_bad_inputs_are_400s_naming_what_to_change(server, hidden_size):
    assert "empty" in error(post(server, {"input": ""}))["message"]
    assert "empty" in error(post(server, {"input": []}))["message"]
    assert "input[1] is empty" in error(post(server, {"input": ["a", ""]}))["message"]
    assert "mixture" in error(post(server, {"input": ["a", [1]]}))["message"]
    over_batch = error(post(server, {"input": [[11] * (MAX_BATCHED + 1)]}))
    assert "--max-num-batched-tokens" in over_batch["message"]
    assert over_batch["code"] == "context_length_exceeded"
    over_context = error(post(server, {"input": [[11], [11] * (MAX_LEN + 1)]}))
    assert over_context["message"].startswith("input[1]: ")
    assert "--max-model-len" in over_context["message"]
    assert "vocabulary" in error(post(server, {"input": [10**9]}))["message"]
    low = error(post(server, {"input": "x", "dimensions": 0}))
    assert low["param"] == "dimensions" and ">= 1" in low["message"]
    high = error(post(server, {"input": "x", "dimensions": hidden_size + 1}))
    assert high["param"] == "dimensions" and str(hidden_size) in high["message"]
    unknown = error(post(server, {"input": "x", "pooling": "mean"}))
    assert unknown["param"] == "pooling" and "not supported" in unknown["message"]
    assert (
        "encoding_format"
        in error(post(server, {"input": "x", "encoding_format": "hex"}))["message"]
    )
    assert post(server, {"input": "x", "model": "other"}).status_code == 404


def test_nulls_are_absent_and_vllm_extras_work(server):
    body = {"input": "nulls", "dimensions": None, "user": None, "encoding_format": None}
    plain = post(server, {**body, "not_a_field": None}).json()
    assert len(plain["data"][0]["embedding"]) > 16 and plain["model"] == "tiny"
    cut = post(server, {"input": [[9, 9, 9, 11, 12, 13]], "truncate_prompt_tokens": 3}).json()
    same = post(server, {"input": [[11, 12, 13]], "user": "u1"}).json()
    assert cut["usage"]["prompt_tokens"] == 3
    assert cut["data"][0]["embedding"] == same["data"][0]["embedding"]
    long_text = {"input": "many words " * 5000, "truncate_prompt_tokens": 16}
    assert post(server, long_text).json()["usage"]["prompt_tokens"] == 16
    assert "characters" in error(post(server, {"input": "many words " * 5000}))["message"]
    bare = post(server, {"input": "abc", "add_special_tokens": False}).json()
    assert bare["usage"]["prompt_tokens"] >= 1


def stream_text(
    base_url: str, prompt: list[int], max_tokens: int, started: threading.Event, out: dict, key: int
) -> None:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    text = []
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                started.set()
                text.append(httpx.Response(200, content=line[6:]).json()["choices"][0]["text"])
    out[key] = "".join(text)


def completion_text(server, prompt: list[int], max_tokens: int) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = post(server, {**body, "ignore_eos": True}, "/v1/completions")
    return response.json()["choices"][0]["text"]


def test_a_64_input_batch_beside_streaming_generations_leaves_their_tokens_unchanged(
    server, client
):
    # Three streams long enough to outlast the batch, and a prompt prefilled in chunks while
    # the batch arrives.
    prompts = [[11 + i, 40, 41, 42] for i in range(3)] + [list(range(20, 320))]
    lengths = [400, 400, 400, 150]
    alone = [completion_text(server, p, n) for p, n in zip(prompts, lengths)]
    texts = [f"input number {i}: " + "word " * (i % 23) for i in range(64)]
    singles = [d.embedding for d in client.embeddings.create(model="tiny", input=texts[:4]).data]
    outputs: dict[int, str] = {}
    started = [threading.Event() for _ in prompts]
    threads = [
        threading.Thread(target=stream_text, args=(server.base_url, p, n, started[i], outputs, i))
        for i, (p, n) in enumerate(zip(prompts, lengths))
    ]
    for thread in threads[:3]:
        thread.start()
    for event in started[:3]:
        assert event.wait(60)
    threads[3].start()
    batch = client.embeddings.create(model="tiny", input=texts)
    streams_running = sum(t.is_alive() for t in threads[:3])
    for thread in threads:
        thread.join(120)
    assert [outputs.get(i) for i in range(4)] == alone
    assert streams_running > 0  # the batch shared steps with the generations
    assert [d.index for d in batch.data] == list(range(64))
    for single, item in zip(singles, batch.data):
        assert cosine(single, item.embedding) > 0.99999


def test_metrics_and_access_lines(server, client):
    before = metric(server, "cpud_embedding_inputs_total")
    client.embeddings.create(model="tiny", input=["one", "two", "three"])
    post(server, {"input": ""})
    assert metric(server, "cpud_embedding_inputs_total") == before + 3
    text = httpx.get(server.base_url + "/metrics").text
    assert 'cpud_requests_total{endpoint="/v1/embeddings",status="200"}' in text
    assert 'cpud_requests_total{endpoint="/v1/embeddings",status="400"}' in text
    assert metric(server, "cpud_embedding_request_latency_seconds_count") >= 1
    deadline = time.monotonic() + 10
    while True:  # the access line follows the answer
        lines = [line for line in server.log().splitlines() if '"POST /v1/embeddings"' in line]
        ok = any(
            " 200 " in line and "id=embd-" in line and "prompt_tokens=" in line for line in lines
        )
        refused = any(" 400 " in line and "error=" in line for line in lines)
        if (ok and refused) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert ok and refused, lines


@pytest.fixture(scope="module")
def encoder(model_factory, tmp_path_factory):
    srv = start_server(model_factory("bert"), tmp_path_factory.mktemp("bert") / "serve.log")
    yield srv
    srv.stop()


GENERATION_ROUTES = [
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"model": "tiny", "input": "hi"}),
]


def test_an_encoder_embeds_and_refuses_generation(encoder):
    from openai import OpenAI

    client = OpenAI(base_url=encoder.base_url + "/v1", api_key="unused", max_retries=0)
    texts = ["an encoder embeds", "every input in one pass"]
    batch = client.embeddings.create(model="tiny", input=texts, dimensions=16)
    for item in batch.data:
        assert len(item.embedding) == 16 and norm(item.embedding) == pytest.approx(1.0, abs=1e-5)
    alone = client.embeddings.create(model="tiny", input=texts[0])
    full = alone.data[0].embedding
    assert norm(full) == pytest.approx(1.0, abs=1e-5)  # CLS, normalised (the fixture says)
    assert cosine(full[:16], batch.data[0].embedding) > 0.99999
    bare = {"prompt": texts[0], "add_special_tokens": False}
    count = httpx.post(encoder.base_url + "/tokenize", json=bare).json()["count"]
    assert alone.usage.prompt_tokens == count + 2  # [CLS] text [SEP]
    for path, body in GENERATION_ROUTES:
        refused = error(post(encoder, body, path))
        assert refused["message"] == "model tiny is an embedding model: use /v1/embeddings"
    messages = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    anthropic = post(encoder, messages, "/v1/messages")
    assert anthropic.status_code == 400 and "/v1/embeddings" in anthropic.text
