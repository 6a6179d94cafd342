"""A generation request checked against the model and the KV cache once, before it reaches the
engine thread; RequestError names what does not fit."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from cpud.engine.admission import Admission
from cpud.engine.sampling_params import SamplingParams
from cpud.settings.config import EngineConfig
from cpud.settings.errors import RequestError
from cpud.structured.compiler import GrammarCompiler


def check_request(
    config: EngineConfig,
    grammars: GrammarCompiler,
    prompt_token_ids: Seq[int],
    params: SamplingParams,
) -> Admission:
    """The request's Admission (its output budget, its compiled grammar), or RequestError.
    Thread-safe; compiles the request's grammar when it has one."""
    if not prompt_token_ids:
        raise RequestError("the prompt is empty", param="prompt")
    if not config.model.generates:
        raise RequestError(
            f"model {config.model_dir.name} is an embedding model: use "
            "/v1/embeddings (LLM.embed offline)",
            param="model",
        )
    vocab = config.model.vocab_size
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
    limit = config.max_model_len
    if len(prompt_token_ids) >= limit:
        raise RequestError(
            f"the prompt has {len(prompt_token_ids)} tokens; this model's context is {limit} "
            f"tokens and needs room for at least one generated token",
            param="prompt",
            code="context_length_exceeded",
        )
    room = limit - len(prompt_token_ids)
    if params.max_tokens is not None and params.max_tokens > room:
        raise RequestError(
            f"max_tokens {params.max_tokens} is too large: the prompt has "
            f"{len(prompt_token_ids)} tokens and the context is {limit}, so at most {room}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    bad = next((t for t, _ in params.logit_bias if t >= vocab), None)
    if bad is not None:
        raise RequestError(
            f"logit_bias names token {bad}, outside the vocabulary [0, {vocab})",
            param="logit_bias",
        )
    grammar = None
    if params.structured is not None:
        grammar = grammars.start(params.structured)
    max_tokens = params.max_tokens or room
    needed = -(-(len(prompt_token_ids) + max_tokens) // config.block_size)
    if needed > config.num_kv_blocks:
        raise RequestError(
            f"the request needs {needed} KV blocks but the whole cache has "
            f"{config.num_kv_blocks}: lower max_tokens or raise --kv-cache-space",
            param="max_tokens",
        )
    return Admission(tuple(prompt_token_ids), params, max_tokens, grammar)
