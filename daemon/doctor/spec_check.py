"""Doctor's speculative decoding item: the --speculative-config the engine would run with."""

from __future__ import annotations

from cpud.doctor.planning import Failed, Planning
from cpud.doctor.report import Check
from cpud.settings.speculative import parse_speculative_config


def spec_check(planning: Planning) -> Check:
    config = planning.config
    if isinstance(config, Failed):
        return Check("speculative decoding", "fail", config.reason, {"error": config.reason})
    spec = parse_speculative_config(config.speculative_config)
    if spec is None:
        return Check(
            "speculative decoding",
            "ok",
            "off (--speculative-config turns on n-gram or draft-model proposals)",
            {"method": None},
        )
    value = {
        "method": spec.method,
        "num_speculative_tokens": spec.num_speculative_tokens,
        "prompt_lookup_min": spec.prompt_lookup_min,
        "prompt_lookup_max": spec.prompt_lookup_max,
        "disable_by_batch_size": spec.disable_by_batch_size,
    }
    if spec.uses_draft_model:
        value.update(draft_model=spec.model, draft_quantization=spec.quantization)
        value["draft_kv_bytes_per_rank"] = config.num_kv_blocks * config.draft_kv_block_bytes
    return Check("speculative decoding", "ok", spec.describe(), value)
