"""KV block bookkeeping in plain Python: allocation, reference counts, prefix caching.

A block is free when no sequence references it. Free blocks that hold a full, hashed block
of tokens stay findable by hash (a prefix-cache hit revives them) until they are reused;
reuse takes the least recently freed block first. A request's cache salt seeds its hash
chain: requests share cached blocks only when their salts (or their lack of one) match.
Changes to the prefix cache can be reported to a KVEventSink (vLLM's KV-cache events).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol


def block_hash(parent: bytes, tokens: Seq[int]) -> bytes:
    """Chained hash: a block's identity includes every token before it."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(b"".join(t.to_bytes(4, "little", signed=True) for t in tokens))
    return digest.digest()


def salt_root(salt: str | None) -> bytes:
    """The seed of a hash chain: empty without a salt, else a digest of it that no chain of
    token blocks can produce."""
    if salt is None:
        return b""
    return hashlib.blake2b(salt.encode(), digest_size=16, person=b"cpud-cache-salt").digest()


class KVEventSink(Protocol):
    """Hears the prefix cache change, as vLLM reports it: full blocks newly cached (their chained
    hashes, the hash of the block before the first, None at a chain's start, and their tokens),
    cached blocks reused for other tokens. A prefix hit changes nothing: the blocks it reuses
    were reported when they were cached (a router that missed that asks the replay socket)."""

    def stored(
        self, parent: bytes | None, hashes: list[bytes], token_ids: list[int], block_size: int
    ) -> None: ...

    def removed(self, hashes: list[bytes]) -> None: ...

    def cleared(self) -> None: ...


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None


@dataclass
class BlockTable:
    """The blocks of one sequence and the hashes of its full, computed blocks; root seeds
    their hash chain (salt_root of the request's cache salt)."""

    block_ids: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    root: bytes = b""


@dataclass(frozen=True)
class PrefixHit:
    block_ids: list[int]
    hashes: list[bytes]
    queried: int = 0  # full prompt blocks looked up

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.events: KVEventSink | None = None

    def publish_to(self, sink: KVEventSink) -> None:
        """Report prefix-cache changes to `sink` from now on (set once, before serving)."""
        self.events = sink

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_prefix(self, token_ids: Seq[int], root: bytes = b"") -> PrefixHit:
        """Longest run of cached full blocks at the start of token_ids whose chain starts at
        root, leaving one token to compute (the step that samples must run at least one
        token)."""
        if not self.enable_prefix_caching:
            return PrefixHit([], [])
        usable = (len(token_ids) - 1) // self.block_size
        block_ids: list[int] = []
        hashes: list[bytes] = []
        parent = root
        for index in range(usable):
            chunk = token_ids[index * self.block_size : (index + 1) * self.block_size]
            parent = block_hash(parent, chunk)
            block_id = self.cached.get(parent)
            if block_id is None:
                break
            block_ids.append(block_id)
            hashes.append(parent)
        return PrefixHit(block_ids, hashes, usable)

    def can_allocate(
        self, table: BlockTable, num_tokens: int, hit: PrefixHit | None = None
    ) -> bool:
        """Whether `table` can grow to cover num_tokens (reusing `hit`'s blocks first)."""
        reused = hit.block_ids if hit else []
        needed = self.blocks_for(num_tokens) - len(table.block_ids) - len(reused)
        revived_free = sum(1 for b in reused if self.blocks[b].ref_count == 0)
        return needed <= self.num_free - revived_free

    def allocate(self, table: BlockTable, num_tokens: int, hit: PrefixHit | None = None) -> None:
        """Grow `table` to cover num_tokens; the caller checked can_allocate.  A prefix lookup
        counts in the hit-rate statistics here, once per admission, not per attempt."""
        if hit:
            self.prefix_queries += hit.queried
            self.prefix_hits += hit.num_blocks
            for block_id, digest in zip(hit.block_ids, hit.hashes):
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.free[block_id]
                block.ref_count += 1
                table.block_ids.append(block_id)
                table.hashes.append(digest)
        needed = self.blocks_for(num_tokens) - len(table.block_ids)
        if needed > self.num_free:
            raise RuntimeError(f"allocate: {needed} blocks needed, {self.num_free} free")
        evicted: list[bytes] = []
        for _ in range(needed):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:
                if self.cached.get(block.hash) == block_id:
                    del self.cached[block.hash]
                    evicted.append(block.hash)
                block.hash = None
            block.ref_count = 1
            table.block_ids.append(block_id)
        if evicted and self.events is not None:
            self.events.removed(evicted)

    def cache_computed(self, table: BlockTable, token_ids: Seq[int], num_computed: int) -> None:
        """Register every full block whose KV is now computed under its chained hash."""
        if not self.enable_prefix_caching:
            return
        parent = table.hashes[-1] if table.hashes else table.root
        stored: list[int] = []  # indexes of the blocks this call caches
        for index in range(len(table.hashes), num_computed // self.block_size):
            chunk = token_ids[index * self.block_size : (index + 1) * self.block_size]
            parent = block_hash(parent, chunk)
            table.hashes.append(parent)
            block = self.blocks[table.block_ids[index]]
            if block.hash is None and parent not in self.cached:
                block.hash = parent
                self.cached[parent] = block.block_id
                stored.append(index)
        if stored and self.events is not None:
            self._report_stored(table, token_ids, stored)

    def _report_stored(self, table: BlockTable, token_ids: Seq[int], stored: list[int]) -> None:
        """One event per run of consecutive newly cached blocks, chained to the block before
        the run (a block another one already caches breaks the run, not the chain)."""
        size = self.block_size
        runs: list[list[int]] = []
        for index in stored:
            if runs and runs[-1][-1] == index - 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        for run in runs:
            first, last = run[0], run[-1]
            self.events.stored(
                table.hashes[first - 1] if first > 0 else None,
                [table.hashes[i] for i in run],
                list(token_ids[first * size : (last + 1) * size]),
                size,
            )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, as vLLM's reset: only while no sequence holds a block
        (False, and nothing changed, otherwise)."""
        if any(block.ref_count for block in self.blocks):
            return False
        for block in self.blocks:
            block.hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    def release(self, table: BlockTable) -> None:
        """Drop the sequence's references; the tail is freed first so it is reused first."""
        for block_id in reversed(table.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {block_id} released more often than taken")
            if block.ref_count == 0:
                self.free[block_id] = None
        table.block_ids.clear()
        table.hashes.clear()
