"""Offline API shaped like vLLM's: LLM(model=...).generate(prompts, SamplingParams(...)),
LLM(model=...).embed(prompts)."""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence as Seq
from typing import Any

from cpud.engine.admission import Admission
from cpud.engine.embedding import embeds_normalized, shortened, truncated
from cpud.engine.executor import make_executor
from cpud.engine.llm_engine import LLMEngine
from cpud.engine.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    OutputAccumulator,
    RequestOutput,
)
from cpud.engine.sampling_params import SamplingParams
from cpud.model.model_dir import resolve_model_dir
from cpud.placement.start import plan_start
from cpud.settings import ENGINE, in_group
from cpud.settings.config import EngineArgs
from cpud.text.tokenizer import Tokenizer

Prompt = str | list[int]
# keyword alias -> setting (tensor_parallel_size -> tp)
KEYWORD_ALIASES = {alias: s.name for s in in_group(ENGINE) for alias in s.keyword_aliases}


def engine_args(model: str | os.PathLike | None, keywords: dict[str, Any]) -> EngineArgs:
    """EngineArgs from LLM(...)'s keywords: the engine settings (cpud.settings) and their
    aliases; TypeError for any other, or for a setting given twice with two values."""
    names = {s.name for s in in_group(ENGINE)} - {"model"}
    chosen: dict[str, Any] = {}
    for keyword, value in keywords.items():
        name = KEYWORD_ALIASES.get(keyword, keyword)
        if name not in names:
            raise TypeError(f"LLM() got an unexpected keyword argument {keyword!r}")
        if value is None and keyword in KEYWORD_ALIASES:
            continue  # an alias left at None gives way to the setting's own keyword
        if name in chosen and chosen[name] != value:
            raise TypeError(f"LLM() got {name} and its alias {keyword} with different values")
        chosen[name] = value
    return EngineArgs(model=model, **chosen)


def _signature() -> inspect.Signature:
    """LLM's signature as the settings table declares it: (self, model=None, *, setting=...)."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for item in in_group(ENGINE):
        if item.name == "model":
            kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
            params.insert(1, inspect.Parameter("model", kind, default=item.default))
            continue
        params.append(inspect.Parameter(item.name, keyword, default=item.default))
        params += [inspect.Parameter(a, keyword, default=None) for a in item.keyword_aliases]
    return inspect.Signature(params)


class LLM:
    def __init__(self, model: str | os.PathLike | None = None, **settings: Any):
        """The engine of `model` (default: SmolLM2-135M-Instruct), set by keywords: every
        engine setting of cpud.settings (dtype, tp or tensor_parallel_size, max_model_len,
        kernels, ...), each defaulting as the table says."""
        args = engine_args(model, settings)
        model_dir = resolve_model_dir(model)
        start = plan_start(args, model_dir)
        self.config = start.config
        self.tokenizer = Tokenizer(model_dir, args.chat_template)
        executor = make_executor(self.config, start.slots)
        self.engine = LLMEngine(self.config, self.tokenizer, executor)
        self._request_ids = 0

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        prompts = prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(prompts)} prompts"
                )
        admissions = []
        for prompt, params in zip(prompts, params_list):
            if isinstance(prompt, str):
                tokens = self.tokenizer.encode(prompt)
                admissions.append((self.engine.validate(tokens, params), prompt))
            else:
                admissions.append((self.engine.validate([int(t) for t in prompt], params), None))
        return self._run(admissions)

    def embed(
        self,
        prompts: Prompt | Seq[Prompt],
        *,
        truncate_prompt_tokens: int | None = None,
        dimensions: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One pooled vector per prompt (pooled and normalised as the model says), in prompt
        order. truncate_prompt_tokens: keep each prompt's last k tokens (-1: as many as the
        context holds); dimensions: the vectors' first values only, renormalised when the
        model normalises (Matryoshka models)."""
        model = self.config.model
        if dimensions is not None and not 1 <= dimensions <= model.hidden_size:
            raise ValueError(f"dimensions must be from 1 to {model.hidden_size}, got {dimensions}")
        admissions = []
        for prompt in prompt_list(prompts):
            text = prompt if isinstance(prompt, str) else None
            tokens = self.tokenizer.encode(prompt) if text is not None else list(map(int, prompt))
            tokens = truncated(tokens, truncate_prompt_tokens, self.config.max_model_len)
            admissions.append((self.engine.validate_embedding(tokens, "prompts"), text))
        outputs = self._run(admissions)
        if dimensions is None:
            return outputs
        normalize = embeds_normalized(model)
        for out in outputs:
            out.outputs = EmbeddingOutput(shortened(out.outputs.embedding, dimensions, normalize))
        return outputs

    def _run(self, admissions: list[tuple[Admission, str | None]]) -> list[Any]:
        """Run checked requests to completion; their whole outputs in the given order (the
        engine's deltas folded per request)."""
        ids = []
        try:
            for admission, text in admissions:
                request_id = str(self._request_ids)
                self._request_ids += 1
                self.engine.admit(request_id, admission, text)
                ids.append(request_id)
            finished: dict[str, Any] = {}
            running: dict[str, OutputAccumulator] = {}
            while self.engine.has_unfinished():
                for output in self.engine.step():
                    if isinstance(output, EmbeddingRequestOutput):
                        finished[output.request_id] = output
                        continue
                    acc = running.setdefault(output.request_id, OutputAccumulator())
                    acc.add(output)
                    if output.finished:
                        finished[output.request_id] = acc.result()
                        del running[output.request_id]
        except BaseException:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        return [finished[request_id] for request_id in ids]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [
            self.tokenizer.encode(
                self.tokenizer.apply_chat_template(conv), add_special_tokens=False
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params)

    def shutdown(self) -> None:
        """Free the model's weights and KV cache (tp = 1) or stop the rank processes (tp > 1);
        the object is unusable afterwards. Dropping the last reference does the same at tp = 1."""
        self.engine.executor.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


LLM.__init__.__signature__ = _signature()


def prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    """One prompt (a string or a list of token ids) or a sequence of them, as a list."""
    if isinstance(prompts, str) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]
    return list(prompts)
