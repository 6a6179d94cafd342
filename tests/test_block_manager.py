"""Block manager invariants, alone (no tensors, no model) and under a random workload."""

from __future__ import annotations

import random

import pytest

from cpud.engine.block_manager import BlockManager, BlockTable


def check_invariants(bm: BlockManager, tables: list[BlockTable]) -> None:
    owners: dict[int, int] = {}
    for table in tables:
        assert len(set(table.block_ids)) == len(table.block_ids), "a table holds a block twice"
        for block_id in table.block_ids:
            owners[block_id] = owners.get(block_id, 0) + 1
    for block in bm.blocks:
        assert block.ref_count == owners.get(block.block_id, 0), f"block {block.block_id} refs"
        assert (block.ref_count == 0) == (block.block_id in bm.free)
    for digest, block_id in bm.cached.items():
        assert bm.blocks[block_id].hash == digest
    assert bm.num_free == bm.num_blocks - len(owners)


def test_allocate_and_release_restore_free_count():
    bm = BlockManager(10, 16, enable_prefix_caching=False)
    table = BlockTable()
    assert bm.can_allocate(table, 33)
    bm.allocate(table, 33)
    assert len(table.block_ids) == 3 and bm.num_free == 7
    bm.allocate(table, 48)  # still 3 blocks
    assert len(table.block_ids) == 3
    bm.allocate(table, 49)
    assert len(table.block_ids) == 4
    assert not bm.can_allocate(table, 16 * 11)
    check_invariants(bm, [table])
    bm.release(table)
    assert bm.num_free == 10 and table.block_ids == []
    check_invariants(bm, [])


def test_prefix_hit_shares_blocks_and_counts():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    tokens = list(range(100, 111))  # 11 tokens: 2 full blocks + 3
    first = BlockTable()
    bm.allocate(first, len(tokens))
    bm.cache_computed(first, tokens, len(tokens))
    assert len(bm.cached) == 2

    hit = bm.find_prefix(tokens + [7])
    assert hit.num_blocks == 2 and hit.block_ids == first.block_ids[:2]
    second = BlockTable()
    bm.allocate(second, 12, hit)
    assert second.block_ids[:2] == first.block_ids[:2]
    assert bm.blocks[first.block_ids[0]].ref_count == 2
    check_invariants(bm, [first, second])
    assert bm.prefix_hits == 2

    # A prompt that is exactly the cached blocks leaves its last token to compute.
    assert bm.find_prefix(tokens[:8]).num_blocks == 1
    # A different first block misses everything after it, even with equal later tokens.
    assert bm.find_prefix([0] + tokens[1:]).num_blocks == 0

    bm.release(first)
    bm.release(second)
    check_invariants(bm, [])
    # Freed cached blocks stay findable until reused.
    assert bm.find_prefix(tokens).num_blocks == 2


def test_cached_free_blocks_are_evicted_when_needed():
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    table = BlockTable()
    tokens = list(range(16))
    bm.allocate(table, 16)
    bm.cache_computed(table, tokens, 16)
    bm.release(table)
    assert len(bm.cached) == 4
    other = BlockTable()
    bm.allocate(other, 16)  # needs every block: all cached entries go
    assert bm.cached == {}
    assert bm.find_prefix(tokens + [1]).num_blocks == 0
    check_invariants(bm, [other])


def test_revived_free_blocks_count_against_free_space():
    bm = BlockManager(3, 4, enable_prefix_caching=True)
    table = BlockTable()
    tokens = list(range(8))
    bm.allocate(table, 8)
    bm.cache_computed(table, tokens, 8)
    bm.release(table)
    hit = bm.find_prefix(tokens + [9])
    assert hit.num_blocks == 2
    fresh = BlockTable()
    # 2 revived + 2 new = 4 > 3 blocks in all.
    assert not bm.can_allocate(fresh, 16, hit)
    assert bm.can_allocate(fresh, 12, hit)
    bm.allocate(fresh, 12, hit)
    check_invariants(bm, [fresh])


def test_release_twice_is_caught():
    bm = BlockManager(2, 4, enable_prefix_caching=False)
    table = BlockTable()
    bm.allocate(table, 4)
    block_ids = list(table.block_ids)
    bm.release(table)
    with pytest.raises(RuntimeError):
        bm.release(BlockTable(block_ids=block_ids))


@pytest.mark.parametrize("seed", range(5))
def test_random_workload_keeps_invariants(seed):
    rng = random.Random(seed)
    bm = BlockManager(40, 4, enable_prefix_caching=True)
    vocab_prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    live: list[tuple[BlockTable, list[int], int]] = []
    for _ in range(400):
        action = rng.random()
        if action < 0.4:
            tokens = rng.choice(vocab_prefixes) + [
                rng.randrange(50) for _ in range(rng.randrange(1, 9))
            ]
            hit = bm.find_prefix(tokens)
            table = BlockTable()
            if bm.can_allocate(table, len(tokens), hit):
                bm.allocate(table, len(tokens), hit)
                bm.cache_computed(table, tokens, len(tokens))
                live.append((table, tokens, len(tokens)))
        elif action < 0.7 and live:
            table, tokens, _ = live[rng.randrange(len(live))]
            tokens.append(rng.randrange(50))
            if bm.can_allocate(table, len(tokens)):
                bm.allocate(table, len(tokens))
                bm.cache_computed(table, tokens, len(tokens))
            else:
                tokens.pop()
        elif live:
            table, _, _ = live.pop(rng.randrange(len(live)))
            bm.release(table)
        check_invariants(bm, [t for t, _, _ in live])
    for table, _, _ in live:
        bm.release(table)
    assert bm.num_free == bm.num_blocks
    assert bm.prefix_hits > 0
