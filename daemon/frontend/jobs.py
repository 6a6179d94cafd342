"""Requests as jobs for the engine: the prompts, the sampling parameters with the output
constraint (response_format, guided_*, the tool-call grammar) and how to answer."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace

from cpud.engine.sampling_params import SamplingParams
from cpud.frontend.constraints import requested_specs, single_spec
from cpud.frontend.errors import bad_request
from cpud.frontend.reasoning import (
    HARMONY,
    ReasoningPlan,
    detect_reasoning_parser,
    plan_reasoning,
)
from cpud.frontend.reasoning_budget import ReasoningBudget, reasoning_budget
from cpud.frontend.requests import Prompt, chat_prompt, completion_prompts, sampling_params
from cpud.frontend.schemas import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from cpud.frontend.state import ServerState
from cpud.frontend.tool_calls import detect_parser
from cpud.frontend.tool_grammar import call_grammar
from cpud.frontend.tool_prompt import chosen_tools, tool_dicts
from cpud.frontend.vllm_chat import echoed_prefix
from cpud.structured.spec import StructuredSpec


@dataclass(frozen=True)
class Job:
    kind: str  # "completion" | "chat"
    request_id: str
    created: int
    model: str
    prompts: list[Prompt]
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool = False
    top_logprobs: int = 0
    prompt_only: bool = False  # echo with max_tokens 0: the prompt alone is answered
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: usage on every chunk
    tool_parser: str | None = None  # parse the output for tool calls in this format
    parallel_tool_calls: bool = True  # else the first call only
    reasoning: ReasoningPlan | None = None  # split the output's reasoning off this way
    reasoning_budget: ReasoningBudget | None = None  # close the reasoning at this many tokens
    answer_prefix: str = ""  # vLLM's echo on chat: the answer starts with this text


def check_prompt_logprobs_stream(body: CompletionRequest | ChatCompletionRequest) -> None:
    if body.stream and body.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs are not available with stream=true", "prompt_logprobs")


def usage_flags(body: CompletionRequest | ChatCompletionRequest) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of stream_options."""
    options = body.stream_options
    if options is None:
        return False, False
    if options.continuous_usage_stats and not options.include_usage:
        raise bad_request(
            "stream_options.continuous_usage_stats needs include_usage true", "stream_options"
        )
    return options.include_usage, options.continuous_usage_stats


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict]  # rendered into the prompt
    parser: str | None  # None: the output is not read for calls
    spec: StructuredSpec | None  # the request's output constraint, tool calls included


def tool_plan(state: ServerState, body: ChatCompletionRequest) -> ToolPlan:
    """What tools and tool_choice ask for (OpenAI's defaults: auto with tools, none without),
    with the request's other constraint. A forced call takes the call grammar: the answer
    that other constraint shapes comes after the tool results, when no call is forced. With
    tool_choice auto the output is either calls or that answer."""
    constraint = output_spec(body)
    if not body.tools:
        if body.tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return ToolPlan([], None, constraint)
    tools = tool_dicts(body.tools)
    if body.tool_choice == "none":
        return ToolPlan(tools, None, constraint)
    template = state.tokenizer.chat_templates.tool_template()
    parser = state.config.tool_call_parser or detect_parser(template)
    callable_tools, required = chosen_tools(tools, body.tool_choice)
    # A named function is called once, as OpenAI does; "required" may call several.
    parallel = body.parallel_tool_calls and not isinstance(body.tool_choice, NamedToolChoice)
    if required:
        spec = call_grammar(callable_tools, parser, parallel)
    elif constraint is not None:
        spec = call_grammar(callable_tools, parser, parallel, answer=constraint)
    else:
        spec = None
    return ToolPlan(tools, parser, spec)


def output_spec(body: CompletionRequest | ChatCompletionRequest) -> StructuredSpec | None:
    return single_spec(requested_specs(body))


def completion_job(state: ServerState, body: CompletionRequest) -> Job:
    if body.max_tokens == 0 and not body.echo:
        raise bad_request(
            "max_tokens must be at least 1 (0 only with echo, to score the prompt)", "max_tokens"
        )
    check_prompt_logprobs_stream(body)
    prompts = completion_prompts(state, body)
    prompt_logprobs = body.prompt_logprobs
    if prompt_logprobs is None and body.echo and body.logprobs is not None:
        prompt_logprobs = body.logprobs
    # As vLLM: max_tokens 0 with echo generates one token and answers without it.
    max_tokens = 1 if body.max_tokens == 0 else body.max_tokens
    params = sampling_params(body, max_tokens, body.logprobs, prompt_logprobs, output_spec(body))
    include_usage, continuous = usage_flags(body)
    return Job(
        "completion",
        f"cmpl-{uuid.uuid4().hex}",
        int(time.time()),
        body.model or state.model_name,
        prompts,
        params,
        body.stream,
        include_usage,
        echo=body.echo,
        top_logprobs=body.logprobs or 0,
        prompt_only=body.echo and body.max_tokens == 0,
        continuous_usage=continuous,
    )


def chat_job(state: ServerState, body: ChatCompletionRequest) -> Job:
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    check_prompt_logprobs_stream(body)
    if body.store:
        raise bad_request("store: true is not supported: cpud stores no completions", "store")
    plan = tool_plan(state, body)
    prompt = chat_prompt(state, body, plan.tools)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens or body.max_tokens
    reasoning = chat_reasoning(state, body, prompt, plan)
    tool_parser = None if reasoning is not None and reasoning.reads_calls else plan.parser
    # Mistral's [TOOL_CALLS] and harmony's markers are special tokens: the parser reads them.
    harmony = reasoning is not None and reasoning.parser == HARMONY
    keep_specials = False if plan.parser == "mistral" or harmony else None
    params = sampling_params(
        body,
        max_tokens,
        logprobs,
        body.prompt_logprobs,
        plan.spec,
        skip_special_tokens=keep_specials,
    )
    include_usage, continuous = usage_flags(body)
    budget = None
    if body.thinking_token_budget is not None:
        read = reasoning or read_plan(state, body, prompt, plan)
        budget = thinking_budget(state, body.thinking_token_budget, read)
    return Job(
        "chat",
        f"chatcmpl-{uuid.uuid4().hex}",
        int(time.time()),
        body.model or state.model_name,
        [prompt],
        params,
        body.stream,
        include_usage,
        top_logprobs=body.top_logprobs or 0,
        continuous_usage=continuous,
        tool_parser=tool_parser,
        parallel_tool_calls=body.parallel_tool_calls,
        answer_prefix=echoed_prefix(body.echo, body.messages),
        reasoning=reasoning,
        reasoning_budget=budget,
    )


def chat_reasoning(
    state: ServerState, body: ChatCompletionRequest, prompt: Prompt, tools: ToolPlan
) -> ReasoningPlan | None:
    """How the output's reasoning is split off (--reasoning-parser, else the chat template's
    format); None when the output has none to split. Calls a format writes with no tools to
    call (none given, tool_choice none) are left out."""
    if body.separate_reasoning is False:
        return None
    plan = read_plan(state, body, prompt, tools)
    if plan is not None and body.include_reasoning is False:
        plan = replace(plan, shown=False)
    if plan is not None and body.stream_reasoning is False:
        plan = replace(plan, streamed=False)
    return plan


def read_plan(
    state: ServerState, body: ChatCompletionRequest, prompt: Prompt, tools: ToolPlan
) -> ReasoningPlan | None:
    """How the output's reasoning reads, whether or not it is split off."""
    parser = state.config.reasoning_parser or detect_reasoning_parser(state.tokenizer.chat_template)
    max_calls = None if body.parallel_tool_calls else 1
    return plan_reasoning(
        parser,
        prompt.text or "",
        body.chat_template_kwargs,
        tools.spec is not None,
        max_calls if tools.parser is not None else 0,
    )


def thinking_budget(
    state: ServerState, tokens: int, plan: ReasoningPlan | None
) -> ReasoningBudget | None:
    """thinking_token_budget as a cap on the output's reasoning; None without reasoning to cap
    (no reasoning format, thinking turned off, a constrained output)."""
    if plan is None:
        return None
    tokenizer = state.tokenizer
    return reasoning_budget(
        plan,
        tokens,
        lambda text: tokenizer.encode(text, add_special_tokens=False),
        lambda token: tokenizer.decode([token], skip_special_tokens=False),
    )
