"""The multi-turn chat workload of perf/bench_dp.py --prefix: many conversations at once, each
over a long document of its own (a system prompt), every turn resending the whole history as
chat clients and agents do.

Two shapes:

    evicting  the case prefix-aware routing exists for: the conversations' working set (every
              conversation at its final length) is larger than one replica's KV cache, which
              holds `cache_share` of it (more than half). Round-robin sends every conversation
              to every replica, so each replica caches all of them and evicts; a router that
              keeps a conversation on one replica splits the working set between the replicas
              and each half fits.
    earlier   the shape measured first: 32 conversations of 4 turns over 300-word documents,
              1 GiB of KV cache per replica (46.6k tokens of the default model, about what the
              documents take), so round-robin hits whenever a turn lands where the one
              before ran.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GiB = 1 << 30
# Chat-template tokens around one message (role markers, newlines), a generous estimate: the
# working set is measured after the run from the answers' usage.
MESSAGE_OVERHEAD = 10


@dataclass(frozen=True)
class Workload:
    name: str
    conversations: int  # all at once, one client each
    turns: int
    words: int  # of each conversation's own document (about 4.8 tokens a word here)
    osl: int  # max_tokens of each answer
    cache_share: float | None  # each replica's KV cache over the working set; None: 1 GiB
    think_s: float  # mean pause before each turn (uniform 0..2x): clients are not in lockstep


WORKLOADS = {
    "evicting": Workload("evicting", 16, 6, 200, 32, cache_share=0.6, think_s=0.2),
    "earlier": Workload("earlier", 32, 4, 300, 128, cache_share=None, think_s=0.0),
}


def document(salt: int, index: int, words: int) -> str:
    return f"Conversation {salt}-{index}. " + " ".join(
        f"w{(index * 7919 + i * 104729) % 5000}" for i in range(words)
    )


def question(turn: int, index: int) -> str:
    return f"Question {turn} of {index}?"


def working_set_estimate(model: Path, work: Workload) -> int:
    """Tokens of every conversation at its last turn, before running: documents counted by the
    model's tokenizer, each turn's question and answer (its max_tokens) plus template tokens."""
    from cpud.text.tokenizer import Tokenizer

    tokenizer = Tokenizer(model)
    total = 0
    for index in range(work.conversations):
        total += len(tokenizer.encode(document(0, index, work.words))) + MESSAGE_OVERHEAD
        for turn in range(work.turns):
            asked = len(tokenizer.encode(question(turn, index)))
            total += asked + work.osl + 2 * MESSAGE_OVERHEAD
    return total


def kv_token_bytes(model: Path, dtype: str = "bfloat16") -> int:
    """KV bytes of one token on a one-rank replica, as cpud's memory plan counts them."""
    from cpud.model.sizes import kv_block_bytes
    from cpud.settings.config import check_model_files

    return kv_block_bytes(check_model_files(model), 1, 1, dtype)


def cache_size(model: Path, work: Workload, block_size: int = 16) -> dict[str, Any]:
    """The --kv-cache-space that holds `cache_share` of the estimated working set (whole
    blocks), and the figures the result states."""
    estimate = working_set_estimate(model, work)
    per_token = kv_token_bytes(model)
    if work.cache_share is None:
        blocks = GiB // (per_token * block_size)
        gib = 1.0
    else:
        blocks = -(-int(work.cache_share * estimate) // block_size)
        gib = (blocks + 0.5) * per_token * block_size / GiB  # half a block: no rounding loss
    return {
        "kv_cache_space_gib": gib,
        "cache_tokens_per_replica": blocks * block_size,
        "working_set_tokens_estimate": estimate,
        "kv_bytes_per_token": per_token,
    }


async def conversations(url: str, work: Workload, seed: int = 0) -> dict[str, Any]:
    """Runs every conversation to its last turn at once. Counts output tokens, and from each
    answer's usage the prompt tokens and those the server served from its prefix cache."""
    import httpx

    salt = int(time.time()) % 100_000
    totals = {"completion_tokens": 0, "prompt_tokens": 0, "cached_tokens": 0}
    final_lengths: list[int] = []

    async def one(index: int, client: httpx.AsyncClient) -> None:
        pause = random.Random(seed * 1000 + index)
        messages = [{"role": "system", "content": document(salt, index, work.words)}]
        length = 0
        for turn in range(work.turns):
            await asyncio.sleep(pause.uniform(0, 2 * work.think_s))
            messages.append({"role": "user", "content": question(turn, index)})
            body = {"model": "bench", "messages": messages, "max_tokens": work.osl}
            reply = await client.post(url + "/v1/chat/completions", json=body)
            reply.raise_for_status()
            data = reply.json()
            usage = data["usage"]
            totals["completion_tokens"] += usage["completion_tokens"]
            totals["prompt_tokens"] += usage["prompt_tokens"]
            details = usage.get("prompt_tokens_details") or {}
            totals["cached_tokens"] += details.get("cached_tokens") or 0
            length = usage["prompt_tokens"] + usage["completion_tokens"]
            messages.append(
                {"role": "assistant", "content": data["choices"][0]["message"]["content"]}
            )
        final_lengths.append(length)

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=900) as client:
        await asyncio.gather(*(one(i, client) for i in range(work.conversations)))
    wall = time.perf_counter() - started
    return {
        "output_tok_s": totals["completion_tokens"] / wall,
        "duration_s": wall,
        **totals,
        "cached_share_of_prompt_tokens": totals["cached_tokens"] / max(totals["prompt_tokens"], 1),
        "working_set_tokens": sum(final_lengths),
    }
