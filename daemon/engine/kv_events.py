"""KV-cache events as vLLM publishes them, for routers that route on cache contents
(vllm-router's kv_aware policy): BlockStored when a full block enters the prefix cache,
BlockRemoved when a cached block is reused for other tokens, AllBlocksCleared when the cache
starts empty.

Configured by vLLM's `--kv-events-config` JSON. Each batch goes out on a ZeroMQ PUB socket as
three frames: the topic, an 8-byte big-endian sequence number, and the msgpack payload
`[ts, [event, ...], data_parallel_rank]`, each event a map tagged by its `type`. A block's
hash on the wire is an unsigned 64-bit integer (the first 8 bytes of cpud's chained block
hash); a router matches prompts against the events' token ids and uses the hashes only to
chain blocks and to remove them. Publishing runs on its own thread: the engine only queues.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from itertools import count

import msgspec

from cpud.settings.errors import ConfigError
from cpud.settings.kv_events_config import KVEventsConfig as KVEventsConfig
from cpud.settings.kv_events_config import offset_endpoint as offset_endpoint

log = logging.getLogger("cpud.kv_events")
# The tier the blocks live in: the engine's own cache, which vLLM calls "GPU" on every platform
# (its CPU backend too); routers credit other tiers (offloaded copies) less.
MEDIUM = "GPU"


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


def wire_hash(digest: bytes) -> int:
    """cpud's block hash as the unsigned 64-bit integer the wire carries."""
    return int.from_bytes(digest[:8], "big")


class KVEventRecorder:
    """What the block manager calls; events wait in a bounded queue for the publisher (when
    it is full an event is dropped and counted, never waited for)."""

    def __init__(self, max_queue_size: int = 100_000):
        self.pending: queue.Queue[KVCacheEvent] = queue.Queue(max_queue_size)
        self.dropped = 0

    def _put(self, event: KVCacheEvent) -> None:
        try:
            self.pending.put_nowait(event)
        except queue.Full:
            self.dropped += 1

    def stored(
        self, parent: bytes | None, hashes: list[bytes], token_ids: list[int], block_size: int
    ) -> None:
        self._put(
            BlockStored(
                [wire_hash(h) for h in hashes],
                None if parent is None else wire_hash(parent),
                list(token_ids),
                block_size,
                lora_id=None,
                medium=MEDIUM,
                lora_name=None,
            )
        )

    def removed(self, hashes: list[bytes]) -> None:
        self._put(BlockRemoved([wire_hash(h) for h in hashes], medium=MEDIUM))

    def cleared(self) -> None:
        self._put(AllBlocksCleared())

    def take(self, wait: float) -> list[KVCacheEvent]:
        """Every queued event, waiting up to `wait` seconds for the first."""
        try:
            events = [self.pending.get(timeout=wait)]
        except queue.Empty:
            return []
        while True:
            try:
                events.append(self.pending.get_nowait())
            except queue.Empty:
                return events


class ZmqEventPublisher:
    """Sends the recorder's events in batches on a PUB socket bound to the endpoint, and,
    with a replay endpoint, answers a ROUTER request (an 8-byte start sequence) with the
    buffered batches from there on, then sequence -1 and an empty payload (vLLM's replay)."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, config: KVEventsConfig, recorder: KVEventRecorder, replica: int = 0):
        import zmq

        self.config = config
        self.recorder = recorder
        self.replica = replica
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            self._pub.bind(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ConfigError(
                f"--kv-events-config: cannot bind {config.endpoint}"
                f"{' / ' + config.replay_endpoint if config.replay_endpoint else ''}: {exc}"
            ) from None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = count()
        self._topic = config.topic.encode()
        self._encoder = msgspec.msgpack.Encoder()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpud-kv-events", daemon=True)

    def start(self) -> None:
        self.recorder.cleared()  # a router's picture of this worker starts over
        self._thread.start()
        log.info("KV cache events on %s (topic %r)", self.config.endpoint, self.config.topic)
        if self.config.endpoint.startswith(("tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:")):
            log.warning(
                "KV cache events listen on every interface (%s): anyone who reaches the port "
                "reads the token ids of cached prompts; bind a private address",
                self.config.endpoint,
            )

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            events = self.recorder.take(wait=0.05)
            if events:
                self._send(events)
        leftover = self.recorder.take(wait=0)
        if leftover:
            self._send(leftover)

    def _send(self, events: list[KVCacheEvent]) -> None:
        seq = next(self._seq)
        payload = self._encoder.encode(KVEventBatch(time.time(), events, self.replica))
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except Exception as exc:  # a send failure loses this batch, never the engine
            log.warning("KV event batch %d not sent: %s", seq, exc)
        self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignored a malformed KV event replay request")
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", self.END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)
        self._close_sockets()
