"""The draft model of speculative decoding, checked before any rank starts: its files read as
the target's are, its vocabulary the target's, its --quantization applicable, and what it costs
each rank: its weights (the whole draft runs in every rank) and its KV per block (the draft's
KV uses the target's block ids, so every rank holds as many draft blocks as target blocks)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from cpud.model.model_config import ModelConfig
from cpud.settings.errors import ConfigError
from cpud.settings.speculative import FLAG, SpeculativeConfig, parse_speculative_config


def check_draft_model(
    spec: SpeculativeConfig, target: ModelConfig, check_files: Callable[[Path], ModelConfig]
) -> ModelConfig:
    """The draft's config (its files checked by check_files, as the target's are); ConfigError
    naming what to change when it cannot draft for target."""
    from cpud.model.quant_check import check_gguf_dense, check_quantization

    path = Path(spec.model or "")
    if not path.exists():
        raise ConfigError(f'{FLAG}: the draft model "{path}" does not exist')
    try:
        draft = check_files(path)
    except ConfigError as exc:
        raise ConfigError(f"{FLAG}: the draft model {path}: {exc}") from None
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(
            f"{FLAG}: the draft model's vocabulary has {draft.vocab_size} tokens, the target's "
            f"{target.vocab_size}: a draft must share the target's tokenizer"
        )
    if not draft.generates:
        raise ConfigError(f"{FLAG}: the draft model {path} generates no text (an encoder)")
    try:
        check_quantization(draft, spec.quantization, 1)
        if path.is_file():
            check_gguf_dense(path, spec.quantization)
    except ConfigError as exc:
        raise ConfigError(f"{FLAG}: the draft's quantization: {exc}") from None
    return draft


def draft_model_config(speculative_config: str | None) -> ModelConfig | None:
    """The draft model's config of a checked --speculative-config (None: no draft model)."""
    from cpud.model.load import load_model_config

    spec = parse_speculative_config(speculative_config)
    if spec is None or not spec.uses_draft_model or spec.model is None:
        return None
    return load_model_config(spec.model)


def draft_kv_block_bytes(
    draft: ModelConfig, block_size: int, dtype: Any, kv_cache_dtype: str = "auto"
) -> int:
    """Bytes one KV block of the draft takes on each rank (the whole draft runs there)."""
    from cpud.model.sizes import kv_block_bytes

    return kv_block_bytes(draft, 1, block_size, dtype, kv_cache_dtype)


def draft_weight_bytes(speculative_config: str | None, draft: ModelConfig, dtype: str) -> int:
    """Bytes of the draft's weights on each rank, as the memory plan counts the target's."""
    from cpud.placement.memory_plan import quantized_weight_bytes

    spec = parse_speculative_config(speculative_config)
    if spec is None or spec.model is None:
        return 0
    return quantized_weight_bytes(draft, dtype, 1, spec.model, spec.quantization)
