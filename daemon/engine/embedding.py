"""Embedding requests: their prompts checked against the engine's limits, their pooled vectors
read from the ranks' bytes and shortened for Matryoshka `dimensions`."""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Sequence as Seq

from cpud.model.model_config import ModelConfig
from cpud.settings.config import EngineConfig
from cpud.settings.errors import RequestError


def embeds_normalized(model: ModelConfig) -> bool:
    """Whether the model's vectors come out normalised (ModelConfig.embedding_pooling: as its
    sentence-transformers files or GGUF say, else vLLM's default of normalising)."""
    return model.embedding_pooling[1]


def embedding_uses_kv(model: ModelConfig) -> bool:
    """A decoder's embedding pass writes its KV blocks; an encoder has no KV cache."""
    return model.generates


def check_embedding_prompt(config: EngineConfig, prompt_token_ids: Seq[int], param: str) -> None:
    """RequestError when the prompt cannot be embedded in one step of this engine."""
    count = len(prompt_token_ids)
    if not count:
        raise RequestError("the input is empty: give at least one token", param=param)
    vocab = config.model.vocab_size
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab})", param=param)
    if count > config.max_model_len:
        raise RequestError(
            f"the input has {count} tokens, more than this model's context of "
            f"{config.max_model_len} tokens (--max-model-len): shorten it or set "
            "truncate_prompt_tokens",
            param=param,
            code="context_length_exceeded",
        )
    if count > config.max_num_batched_tokens:
        raise RequestError(
            f"the input has {count} tokens; an input is embedded in one step and a step "
            f"computes at most {config.max_num_batched_tokens} tokens "
            "(--max-num-batched-tokens): shorten it, set truncate_prompt_tokens or raise "
            "--max-num-batched-tokens",
            param=param,
            code="context_length_exceeded",
        )
    if embedding_uses_kv(config.model):
        needed = -(-count // config.block_size)
        if needed > config.num_kv_blocks:
            raise RequestError(
                f"the input needs {needed} KV blocks for its pass but the whole cache has "
                f"{config.num_kv_blocks}: shorten it or raise --kv-cache-space",
                param=param,
            )


def truncated(tokens: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last `keep` tokens (-1: as many as the context
    holds); None keeps them all."""
    if keep is None:
        return tokens
    if keep == -1:
        keep = max_model_len
    if keep < 1:
        raise RequestError(
            f"truncate_prompt_tokens must be -1 or at least 1, got {keep}",
            param="truncate_prompt_tokens",
        )
    return tokens[-keep:]


def vector_from_bytes(data: bytes) -> list[float]:
    """float32 little-endian bytes (what the ranks send) as Python floats."""
    if len(data) % 4:
        raise ValueError(f"an embedding of {len(data)} bytes is not a float32 vector")
    values = array("f")
    values.frombytes(data)
    if sys.byteorder != "little":
        values.byteswap()
    return values.tolist()


def vector_bytes(vector: Seq[float]) -> bytes:
    """float32 little-endian bytes of a vector (what base64 embeddings carry)."""
    values = array("f", vector)
    if sys.byteorder != "little":
        values.byteswap()
    return values.tobytes()


def shortened(vector: Seq[float], dimensions: int | None, normalize: bool) -> list[float]:
    """The first `dimensions` values (Matryoshka), scaled back to unit length when the model
    normalises its vectors; the vector as it is when dimensions is None or its full size."""
    if dimensions is None or dimensions >= len(vector):
        return list(vector)
    head = list(vector[:dimensions])
    if not normalize:
        return head
    norm = math.sqrt(math.fsum(v * v for v in head))
    return head if norm == 0.0 else [v / norm for v in head]
