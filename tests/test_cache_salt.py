"""The prefix cache keeps tenants apart by cache salt: a request reuses the cached blocks of
earlier requests only when their salts (or their lack of one) match, so no client can learn by
cache hits what another sent."""

from __future__ import annotations

import pytest

from cpud.engine.block_manager import BlockManager, block_hash, salt_root
from cpud.engine.detokenizer import IncrementalDetokenizer
from cpud.engine.sampling_params import SamplingParams
from cpud.engine.scheduler import Scheduler
from cpud.engine.sequence import Sequence
from cpud.settings.errors import RequestError

BLOCK = 16
PROMPT = list(range(100, 150))  # three full blocks and a bit


class NullDecoder:
    def decode(self, token_ids, skip_special_tokens=True):
        return ""


def served(scheduler: Scheduler, seq_id: int, salt: str | None) -> int:
    """Run one request's prefill as the engine does and return the prompt tokens the prefix
    cache served it."""
    seq = Sequence(
        seq_id,
        str(seq_id),
        0,
        list(PROMPT),
        SamplingParams(cache_salt=salt),
        IncrementalDetokenizer(NullDecoder()),
        None,
    )
    scheduler.add(seq)
    while seq.num_uncomputed:
        for item in scheduler.schedule().scheduled:
            item.seq.num_computed_tokens += item.num_tokens
            scheduler.blocks.cache_computed(
                item.seq.blocks, item.seq.token_ids, item.seq.num_computed_tokens
            )
    scheduler.finish(seq)
    return seq.num_cached_tokens


def test_only_requests_of_one_salt_share_cached_blocks():
    scheduler = Scheduler(BlockManager(64, BLOCK, True), max_num_seqs=4, max_batched_tokens=512)
    assert served(scheduler, 1, "tenant-a") == 0
    assert served(scheduler, 2, "tenant-a") == 3 * BLOCK
    assert served(scheduler, 3, "tenant-b") == 0
    assert served(scheduler, 4, None) == 0
    assert served(scheduler, 5, None) == 3 * BLOCK
    assert served(scheduler, 6, "tenant-b") == 3 * BLOCK


def test_a_salted_chain_starts_where_no_unsalted_chain_can():
    first = PROMPT[:BLOCK]
    assert salt_root(None) == b""
    assert salt_root("a") != salt_root("b")
    assert block_hash(salt_root("a"), first) != block_hash(b"", first)
    manager = BlockManager(8, BLOCK, True)
    assert manager.find_prefix(PROMPT, salt_root("a")).num_blocks == 0


@pytest.mark.parametrize("salt", ["", 5, b"x"])
def test_a_salt_must_be_a_nonempty_string(salt):
    with pytest.raises(RequestError, match="cache_salt must be a non-empty string"):
        SamplingParams(cache_salt=salt)
