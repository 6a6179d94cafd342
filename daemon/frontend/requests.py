"""Turn validated request bodies into engine inputs: token ids and SamplingParams."""

from __future__ import annotations

import json
from dataclasses import dataclass

import msgspec

from cpud.engine.admission import Admission
from cpud.engine.sampling_params import SamplingParams
from cpud.frontend.errors import APIError, bad_request
from cpud.frontend.schemas import ChatCompletionRequest, CompletionRequest, Strict
from cpud.frontend.state import ServerState
from cpud.frontend.tool_prompt import (
    conversation,
    hermes_system_prompt,
    template_knows_tools,
    with_system_prompt,
)
from cpud.frontend.vllm_chat import check_continue, open_final_message, truncate_prompt
from cpud.settings.errors import RequestError
from cpud.structured.spec import StructuredSpec


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str | None


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in state.config.served_model_names:
        raise APIError(
            404,
            f"model {model!r} does not exist; this server serves "
            f"{', '.join(state.config.served_model_names)}",
            "invalid_request_error",
            "model",
            "model_not_found",
        )


def check_generates(state: ServerState, model: str | None) -> None:
    """A generation route on a model that only embeds is a 400 pointing at /v1/embeddings."""
    if not state.engine.engine.config.model.generates:
        raise bad_request(
            f"model {model or state.model_name} is an embedding model: use /v1/embeddings",
            param="model",
            code="model_not_generative",
        )


def refuse_unsupported(body: Strict, where: str = "") -> None:
    """A 400 naming the first field (of the body or of an object in it) that asks for
    something cpud does not do: a value its type's `unsupported` table does not accept."""
    for name, rule in type(body).unsupported.items():
        value = getattr(body, name)
        if value is not None and not rule.accepts(value):
            shown = json.dumps(msgspec.to_builtins(value))
            if len(shown) > 200:
                shown = shown[:200] + "..."
            raise bad_request(
                f"{where}{name} {shown} is not supported: {rule.hint}",
                param=f"{where}{name}",
                code="unsupported_parameter",
            )
    for name in body.__struct_fields__:
        value = getattr(body, name)
        if isinstance(value, Strict):
            refuse_unsupported(value, f"{where}{name}.")


def check_kv_room(state: ServerState, admission: Admission) -> None:
    """The n sequences of one request must fit in the KV cache together: more is a 400 that
    says what to lower, never a request that waits on itself."""
    n = admission.params.n
    if n == 1:
        return
    config = state.engine.engine.config
    tokens = len(admission.prompt_token_ids) + admission.max_tokens
    blocks = n * -(-tokens // config.block_size)
    if blocks > config.num_kv_blocks:
        raise RequestError(
            f"n={n} sequences of up to {tokens} tokens (prompt and max_tokens) need {blocks} KV "
            f"blocks together but the whole cache has {config.num_kv_blocks}: lower n or "
            "max_tokens (or raise --kv-cache-space)",
            param="n",
        )


RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "self"})


def check_text_size(state: ServerState, chars: int, param: str) -> None:
    """Refuse, before tokenizing, a text that cannot fit in the context whatever its tokens."""
    if chars > state.max_prompt_chars:
        raise bad_request(
            f"the {param} has {chars} characters, more than the {state.config.max_model_len} "
            f"tokens of this model's context can hold (at most {state.max_prompt_chars}): "
            "shorten it",
            param=param,
            code="context_length_exceeded",
        )


def cut(state: ServerState, prompt: Prompt, keep: int | None) -> Prompt:
    """The prompt cut to its last `keep` tokens (vLLM's truncate_prompt_tokens)."""
    if keep is None:
        return prompt
    return Prompt(*truncate_prompt(prompt.token_ids, prompt.text, keep, state.config.max_model_len))


def completion_prompts(state: ServerState, body: CompletionRequest) -> list[Prompt]:
    """The prompts, each cut to truncate_prompt_tokens."""
    return [cut(state, p, body.truncate_prompt_tokens) for p in given_prompts(state, body)]


def given_prompts(state: ServerState, body: CompletionRequest) -> list[Prompt]:
    """prompt as a string, a list of strings, a list of token ids or a list of those."""
    raw = body.prompt

    def encode(text: str) -> list[int]:
        check_text_size(state, len(text), "prompt")
        return state.tokenizer.encode(text)

    if isinstance(raw, str):
        return [Prompt(encode(raw), raw)]
    if not raw:
        raise bad_request("prompt must not be empty", param="prompt")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in raw):
        return [Prompt(list(raw), None)]
    if len(raw) > state.config.max_prompts:
        raise bad_request(
            f"at most {state.config.max_prompts} prompts per request, got {len(raw)}",
            param="prompt",
        )
    if all(isinstance(p, str) for p in raw):
        return [Prompt(encode(p), p) for p in raw]
    if all(isinstance(p, list) for p in raw):
        return [Prompt(list(p), None) for p in raw]
    raise bad_request(
        "prompt must be a string, a list of strings, a list of token ids or a list of "
        "token id lists, not a mixture",
        param="prompt",
    )


def chat_prompt(
    state: ServerState, body: ChatCompletionRequest, tools: list[dict] | None = None
) -> Prompt:
    """The conversation through the chat template, tools included. A template that takes
    `tools` gets them as transformers passes them; for one that does not (SmolLM2's), the
    tool list goes into the system prompt in the Hermes format and earlier calls and results
    into the messages' text, as vLLM and llama-server do."""
    extra = dict(body.chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & extra.keys())
    if reserved:
        raise RequestError(
            f"chat_template_kwargs may not set {', '.join(map(repr, reserved))}: send the "
            "conversation as messages",
            param="chat_template_kwargs",
        )
    if body.reasoning_effort is not None:
        extra.setdefault("reasoning_effort", body.reasoning_effort)
    native = template_knows_tools(state.tokenizer.chat_templates.tool_template())
    messages = conversation(body.messages, native)
    if tools and native:
        extra["tools"] = tools
    elif tools:
        messages = with_system_prompt(messages, hermes_system_prompt(tools))
    check_text_size(state, sum(len(m["content"]) for m in messages), "messages")
    add_generation_prompt = extra.pop("add_generation_prompt", body.add_generation_prompt)
    check_continue(body.continue_final_message, add_generation_prompt)
    text = state.tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, **extra
    )
    if body.continue_final_message:
        text = open_final_message(text, messages)
    check_text_size(state, len(text), "messages")
    token_ids = state.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    return cut(state, Prompt(token_ids, text), body.truncate_prompt_tokens)


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    structured: StructuredSpec | None = None,
    skip_special_tokens: bool | None = None,
) -> SamplingParams:
    """The body's sampling fields; `structured` is the request's one output constraint."""
    stop = body.stop
    if isinstance(stop, str):
        stop = [stop]
    values = {
        "n": body.n,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty,
    }
    kwargs = {k: v for k, v in values.items() if v is not None}
    try:
        return SamplingParams(
            **kwargs,
            seed=body.seed,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=tuple(stop or ()),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output or body.no_stop_trim,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=(
                body.skip_special_tokens if skip_special_tokens is None else skip_special_tokens
            ),
            structured=structured,
            logit_bias=body.logit_bias or (),
            cache_salt=body.cache_salt,
        )
    except RequestError as exc:
        raise bad_request(str(exc), param=exc.param) from None
