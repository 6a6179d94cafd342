"""vLLM's render endpoints (`POST /v1/chat/completions/render`, `/v1/completions/render`,
`/v1/responses/render`):
a request turned into what the engine would run, without running it. vllm-router calls them
before each request to route on the prompt's token ids. The answer is vLLM's GenerateRequest
(a list of them for completions): request id, token ids, sampling parameters."""

from __future__ import annotations

import uuid

from cpud.engine.sampling_params import SamplingParams
from cpud.frontend.errors import bad_request
from cpud.frontend.jobs import Job, chat_job, completion_job
from cpud.frontend.requests import Prompt
from cpud.frontend.responses_api import chat_request
from cpud.frontend.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponsesRequest,
    StreamOptions,
)
from cpud.frontend.state import ServerState


def vllm_sampling_params(params: SamplingParams, max_tokens: int) -> dict:
    """cpud's resolved parameters under vLLM's SamplingParams names."""
    return {
        "n": params.n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "seed": params.seed,
        "stop": list(params.stop),
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
        "max_tokens": max_tokens,
        "min_tokens": params.min_tokens,
        "logprobs": params.logprobs,
        "prompt_logprobs": params.prompt_logprobs,
        "skip_special_tokens": params.skip_special_tokens,
        "include_stop_str_in_output": params.include_stop_str_in_output,
    }


def generate_request(
    state: ServerState,
    job: Job,
    prompt: Prompt,
    prefix: str,
    stream_options: StreamOptions | None,
) -> dict:
    """One prompt of `job` as vLLM's GenerateRequest; a prompt with no room left in the
    context is the 400 the request itself would get."""
    limit = state.config.max_model_len
    room = limit - len(prompt.token_ids)
    if room < 1:
        raise bad_request(
            f"the prompt has {len(prompt.token_ids)} tokens; this model's context is {limit} "
            "tokens and needs room for at least one generated token",
            param="prompt",
            code="context_length_exceeded",
        )
    max_tokens = job.params.max_tokens if job.params.max_tokens is not None else room
    return {
        "request_id": f"{prefix}-{uuid.uuid4().hex}",
        "token_ids": prompt.token_ids,
        "features": None,
        "sampling_params": vllm_sampling_params(job.params, min(max_tokens, room)),
        "model": job.model,
        "stream": job.stream,
        "stream_options": (
            {
                "include_usage": stream_options.include_usage,
                "continuous_usage_stats": stream_options.continuous_usage_stats,
            }
            if job.stream and stream_options is not None
            else None
        ),
        "cache_salt": job.params.cache_salt,
        "priority": 0,
        "kv_transfer_params": None,
    }


def rendered_chat(state: ServerState, body: ChatCompletionRequest) -> dict:
    job = chat_job(state, body)
    return generate_request(state, job, job.prompts[0], "chatcmpl", body.stream_options)


def rendered_completions(state: ServerState, body: CompletionRequest) -> list[dict]:
    job = completion_job(state, body)
    return [generate_request(state, job, p, "cmpl", body.stream_options) for p in job.prompts]


def rendered_responses(state: ServerState, body: ResponsesRequest) -> dict:
    job = chat_job(state, chat_request(body))
    return generate_request(state, job, job.prompts[0], "resp", None)
