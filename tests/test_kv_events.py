"""KV-cache events in vLLM's format: what the block manager reports, the batches on the ZeroMQ
PUB socket (as a SUB decodes them), the replay socket, --kv-events-config's checks, and a live
server publishing the blocks of a prompt it ran."""

from __future__ import annotations

import time

import httpx
import msgspec
import pytest
import zmq

from cpud.engine.block_manager import BlockManager, BlockTable, block_hash
from cpud.engine.kv_events import (
    KVEventRecorder,
    KVEventsConfig,
    ZmqEventPublisher,
    offset_endpoint,
    wire_hash,
)
from cpud.settings.errors import ConfigError
from cpud_server_helpers import free_port, start_server

SIZE = 4


class Heard:
    def __init__(self):
        self.events: list[tuple] = []

    def stored(self, parent, hashes, token_ids, block_size):
        self.events.append(("stored", parent, list(hashes), list(token_ids), block_size))

    def removed(self, hashes):
        self.events.append(("removed", list(hashes)))

    def cleared(self):
        self.events.append(("cleared",))


def run(manager: BlockManager, tokens: list[int], root: bytes = b"") -> BlockTable:
    table = BlockTable(root=root)
    hit = manager.find_prefix(tokens, root)
    manager.allocate(table, len(tokens), hit)
    manager.cache_computed(table, tokens, len(tokens))
    return table


def chain(tokens: list[int], root: bytes = b"") -> list[bytes]:
    hashes, parent = [], root
    for i in range(len(tokens) // SIZE):
        parent = block_hash(parent, tokens[i * SIZE : (i + 1) * SIZE])
        hashes.append(parent)
    return hashes


def test_cached_blocks_are_stored_events_chained_to_their_parent():
    manager = BlockManager(8, SIZE, enable_prefix_caching=True)
    heard = Heard()
    manager.publish_to(heard)
    tokens = list(range(10))  # two full blocks and a partial one
    table = run(manager, tokens)
    hashes = chain(tokens)
    assert heard.events == [("stored", None, hashes, tokens[:8], SIZE)]
    # The sequence grows by a block: one more event, chained to the last cached block.
    more = tokens + [10, 11]
    manager.allocate(table, len(more))
    manager.cache_computed(table, more, len(more))
    assert heard.events[-1] == ("stored", hashes[-1], chain(more)[2:], more[8:12], SIZE)


def test_a_prefix_hit_stores_only_the_new_blocks_chained_to_the_reused_ones():
    """As vLLM: the reused blocks were announced when first cached, never again."""
    manager = BlockManager(8, SIZE, enable_prefix_caching=True)
    heard = Heard()
    manager.publish_to(heard)
    first = list(range(8))
    run(manager, first)
    second = first + [20, 21, 22, 23, 24]
    run(manager, second)
    hashes = chain(second)
    assert heard.events == [
        ("stored", None, hashes[:2], first, SIZE),
        ("stored", hashes[1], hashes[2:], second[8:12], SIZE),
    ]
    run(manager, second)  # a whole hit: nothing is new
    assert len(heard.events) == 2


def test_reusing_a_cached_block_is_a_removed_event():
    manager = BlockManager(2, SIZE, enable_prefix_caching=True)
    heard = Heard()
    manager.publish_to(heard)
    first = run(manager, list(range(8)))
    manager.release(first)
    run(manager, list(range(100, 105)))  # needs both blocks: both cached ones are reused
    removed = [e for e in heard.events if e[0] == "removed"]
    assert removed == [("removed", list(reversed(chain(list(range(8))))))]


def test_a_block_another_block_caches_is_not_stored_twice():
    manager = BlockManager(8, SIZE, enable_prefix_caching=True)
    tokens = list(range(8))
    # Two sequences computing the same prompt at once: neither found the other's blocks.
    a, b = BlockTable(), BlockTable()
    manager.allocate(a, 8)
    manager.allocate(b, 8)
    heard = Heard()
    manager.publish_to(heard)
    manager.cache_computed(a, tokens, 8)
    manager.cache_computed(b, tokens, 8)
    assert [e[0] for e in heard.events] == ["stored"]


def test_a_salted_chain_starts_without_a_parent():
    manager = BlockManager(8, SIZE, enable_prefix_caching=True)
    heard = Heard()
    manager.publish_to(heard)
    root = b"salt-root-digest"
    run(manager, list(range(5)), root)
    assert heard.events == [("stored", None, chain(list(range(5)), root), list(range(4)), SIZE)]


def test_a_reset_forgets_every_block_and_clears_subscribers():
    manager = BlockManager(8, SIZE, enable_prefix_caching=True)
    heard = Heard()
    manager.publish_to(heard)
    held = run(manager, list(range(8)))
    assert not manager.reset_prefix_cache()  # a sequence holds blocks: nothing changes
    assert manager.cached and heard.events[-1][0] == "stored"
    manager.release(held)
    assert manager.reset_prefix_cache()
    assert not manager.cached and heard.events[-1] == ("cleared",)
    assert manager.find_prefix(list(range(9))).num_blocks == 0


def subscriber(ctx: zmq.Context, endpoint: str, topic: bytes = b"") -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(endpoint)
    return sub


def until_received(sub: zmq.Socket, poke) -> list[bytes]:
    """PUB/SUB drops what is sent before the subscription lands: poke until a batch arrives."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        poke()
        if sub.poll(200):
            return sub.recv_multipart()
    raise AssertionError("no KV event batch arrived")


def test_batches_on_the_wire_are_vllms_layout():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint, topic="kv")
    recorder = KVEventRecorder()
    publisher = ZmqEventPublisher(config, recorder, replica=3)
    ctx = zmq.Context()
    sub = subscriber(ctx, endpoint, b"kv")
    try:
        publisher.start()
        digest = block_hash(b"", [1, 2, 3, 4])
        topic, seq, payload = until_received(sub, lambda: recorder.removed([digest]))
        while msgspec.msgpack.decode(payload)[1] == [{"type": "AllBlocksCleared"}]:
            topic, seq, payload = sub.recv_multipart()  # the start's batch, caught in time
        assert topic == b"kv" and len(seq) == 8
        ts, events, rank = msgspec.msgpack.decode(payload)
        assert abs(ts - time.time()) < 60 and rank == 3
        assert events[-1] == {"type": "BlockRemoved", "block_hashes": [wire_hash(digest)],
                              "medium": "GPU"}  # fmt: skip
        recorder.stored(digest, [digest], [5, 6, 7, 8], 4)
        topic, seq2, payload = sub.recv_multipart()
        assert int.from_bytes(seq2, "big") == int.from_bytes(seq, "big") + 1
        (stored,) = msgspec.msgpack.decode(payload)[1]
        assert stored == {
            "type": "BlockStored",
            "block_hashes": [wire_hash(digest)],
            "parent_block_hash": wire_hash(digest),
            "token_ids": [5, 6, 7, 8],
            "block_size": 4,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
        assert 0 <= wire_hash(digest) < 1 << 64
    finally:
        publisher.shutdown()
        sub.close(linger=0)
        ctx.term()


def test_replay_answers_the_buffered_batches_then_the_end_marker():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    replay = f"tcp://127.0.0.1:{free_port()}"
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint, replay_endpoint=replay)
    recorder = KVEventRecorder()
    publisher = ZmqEventPublisher(config, recorder)
    publisher.start()  # its first batch: AllBlocksCleared
    ctx = zmq.Context()
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.RCVTIMEO, 5000)
    req.connect(replay)
    try:
        deadline = time.monotonic() + 5
        while not publisher._buffer and time.monotonic() < deadline:
            time.sleep(0.01)
        req.send((0).to_bytes(8, "big"))
        seq, payload = req.recv_multipart()
        assert int.from_bytes(seq, "big") == 0
        assert msgspec.msgpack.decode(payload)[1] == [{"type": "AllBlocksCleared"}]
    finally:
        publisher.shutdown()
        req.close(linger=0)
        ctx.term()


def test_config_is_vllms_json():
    assert not KVEventsConfig.parse(None).enabled
    on = KVEventsConfig.parse('{"enable_kv_cache_events": true, "topic": "kv"}')
    assert on.enabled and on.topic == "kv" and on.endpoint == "tcp://127.0.0.1:5557"
    null = KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "null"}')
    assert not null.enabled
    assert on.for_replica(2).endpoint == "tcp://127.0.0.1:5559"
    assert offset_endpoint("ipc:///run/cpud/kv", 1) == "ipc:///run/cpud/kv_dp1"


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("{not json", "not valid JSON"),
        ("[1]", "JSON object"),
        ('{"enable_kv_cache_events": true, "endpiont": "x"}', "endpiont"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"endpoint": "http://host:1"}', "endpoint"),
        ('{"hwm": 0}', "hwm"),
    ],
)
def test_bad_config_is_a_config_error_naming_the_key(text, named):
    with pytest.raises(ConfigError, match=named):
        KVEventsConfig.parse(text)


def test_a_taken_endpoint_is_a_config_error():
    port = free_port()
    ctx = zmq.Context()
    holder = ctx.socket(zmq.PUB)
    holder.bind(f"tcp://127.0.0.1:{port}")
    try:
        config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port}")
        with pytest.raises(ConfigError, match="cannot bind"):
            ZmqEventPublisher(config, KVEventRecorder())
    finally:
        holder.close(linger=0)
        ctx.term()


@pytest.mark.slow
def test_a_server_publishes_the_blocks_of_the_prompts_it_runs(model_factory, tmp_path):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = f'{{"enable_kv_cache_events": true, "endpoint": "{endpoint}"}}'
    server = start_server(
        model_factory("qwen3"), tmp_path / "serve.log", "--kv-events-config", config
    )
    ctx = zmq.Context()
    sub = subscriber(ctx, endpoint)
    sent: list[list[int]] = []

    def poke() -> None:
        # A new prompt each time: a repeated one would hit the cache and store nothing.
        prompt = f"{len(sent)} the quick brown fox jumps over the lazy dog " * 4
        sent.append(httpx.post(server.base_url + "/tokenize", json={"prompt": prompt}).json())
        body = {"prompt": prompt, "max_tokens": 1}
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)

    try:
        frames = until_received(sub, poke)
        events = msgspec.msgpack.decode(frames[2])[1]
        while sub.poll(1000):
            events += msgspec.msgpack.decode(sub.recv_multipart()[2])[1]
        stored = [e for e in events if e["type"] == "BlockStored"]
        assert stored
        prompts = [answer["tokens"] for answer in sent]
        for event in stored:
            assert event["parent_block_hash"] is None and event["block_size"] == 16
            assert len(event["token_ids"]) % 16 == 0
            assert any(event["token_ids"] == p[: len(event["token_ids"])] for p in prompts)
            assert all(len(event["token_ids"]) <= len(p) // 16 * 16 for p in prompts)
    finally:
        sub.close(linger=0)
        ctx.term()
        assert server.stop() == 0
