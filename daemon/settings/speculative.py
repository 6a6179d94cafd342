"""--speculative-config: vLLM's JSON shape, read once into a frozen config.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
     "prompt_lookup_max": 5, "disable_by_batch_size": 8}
    {"method": "draft_model", "model": "/models/small.gguf", "num_speculative_tokens": 4}

A draft model runs whole (TP 1) inside every rank; vLLM's "draft_tensor_parallel_size" is taken
when it is 1, and "quantization" is the draft's --quantization (default auto).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from cpud.settings.errors import ConfigError

METHODS = ("ngram", "draft_model")
NOT_BUILT = ("eagle", "eagle3", "mtp", "medusa", "mlp_speculator")
DEFAULT_LOOKUP_MIN = 2
DEFAULT_LOOKUP_MAX = 5
# Running sequences above which no sequence speculates: past it a step is no longer bound by
# reading the weights, so verifying proposals costs compute that plain decoding does not.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
FLAG = "--speculative-config"


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_LOOKUP_MIN
    prompt_lookup_max: int = DEFAULT_LOOKUP_MAX
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    model: str | None = None  # the draft model's path (draft_model)
    quantization: str = "auto"  # the draft's --quantization (draft_model)

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    def describe(self) -> str:
        """One line for the startup log and doctor."""
        k = self.num_speculative_tokens
        if self.uses_draft_model:
            how = f"draft model {self.model} (quantization {self.quantization}, TP 1 in every rank)"
        else:
            how = f"n-grams of {self.prompt_lookup_min}..{self.prompt_lookup_max} tokens"
        return (
            f"{self.method}, {k} proposed tokens per step, {how}, off above "
            f"{self.disable_by_batch_size} running sequences"
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def _whole(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(
            f"{FLAG}: {name} must be a whole number of at least {minimum}, got {value!r}"
        )
    return value


def parse_speculative_config(value: str | dict | None) -> SpeculativeConfig | None:
    """The config from a JSON object (text from the command line, or a dict from LLM(...));
    None for none. ConfigError naming what to change for anything else."""
    if value is None or value == "":
        return None
    if isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{FLAG} is not valid JSON ({exc.msg} at character {exc.pos}): give an object "
                'such as {"method": "ngram", "num_speculative_tokens": 4}'
            ) from None
    if not isinstance(value, dict):
        raise ConfigError(f"{FLAG} must be a JSON object, got {type(value).__name__}")
    fields = dict(value)
    method = fields.pop("method", None)
    if method is None and "model" in fields:
        method = "draft_model"
    if method in NOT_BUILT:
        raise ConfigError(
            f'{FLAG}: method {method!r} is not supported by cpud yet; use "ngram" (prompt lookup)'
        )
    if method not in METHODS:
        raise ConfigError(f'{FLAG}: method must be "ngram" or "draft_model", got {method!r}')
    model, quantization = _draft_fields(method, fields)
    if "num_speculative_tokens" not in fields:
        raise ConfigError(f"{FLAG}: num_speculative_tokens is required (try 4)")
    k = _whole("num_speculative_tokens", fields.pop("num_speculative_tokens"), 1)
    lookup_min = fields.pop("prompt_lookup_min", None)
    lookup_max = fields.pop("prompt_lookup_max", None)
    if lookup_min is None and lookup_max is None:
        lookup_min, lookup_max = DEFAULT_LOOKUP_MIN, DEFAULT_LOOKUP_MAX
    elif lookup_min is None:
        lookup_min = min(DEFAULT_LOOKUP_MIN, _whole("prompt_lookup_max", lookup_max, 1))
    elif lookup_max is None:
        lookup_max = max(DEFAULT_LOOKUP_MAX, _whole("prompt_lookup_min", lookup_min, 1))
    lookup_min = _whole("prompt_lookup_min", lookup_min, 1)
    lookup_max = _whole("prompt_lookup_max", lookup_max, 1)
    if lookup_min > lookup_max:
        raise ConfigError(
            f"{FLAG}: prompt_lookup_min {lookup_min} is above prompt_lookup_max {lookup_max}"
        )
    batch = fields.pop("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
    batch = _whole("disable_by_batch_size", batch, 1)
    if fields:
        raise ConfigError(
            f"{FLAG}: unknown key(s) {', '.join(sorted(map(str, fields)))}; known: method, "
            "model, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, "
            "disable_by_batch_size, draft_tensor_parallel_size, quantization"
        )
    return SpeculativeConfig(method, k, lookup_min, lookup_max, batch, model, quantization)


def _draft_fields(method: str, fields: dict) -> tuple[str | None, str]:
    """The draft model's path and quantization (taken out of fields); (None, "auto") for
    n-gram lookup, which vLLM also spells {"model": "[ngram]"}."""
    model = fields.pop("model", None)
    tp = fields.pop("draft_tensor_parallel_size", 1)
    quantization = fields.pop("quantization", None)
    if method != "draft_model":
        return None, "auto"
    if not isinstance(model, str) or not model:
        raise ConfigError(
            f'{FLAG}: method "draft_model" needs "model": the path of the draft model (a GGUF '
            "file or a model directory sharing the target's tokenizer)"
        )
    if tp != 1:
        raise ConfigError(
            f"{FLAG}: draft_tensor_parallel_size must be 1 (the draft runs whole in every rank), "
            f"got {tp!r}"
        )
    if quantization is None:
        return model, "auto"
    if not isinstance(quantization, str):
        raise ConfigError(f"{FLAG}: quantization must be a string, got {quantization!r}")
    return model, quantization
