"""What the model is: architecture, shape, and for a GGUF file its tensor types with their bytes
(the file's real sizes), so an operator sees what `--model` will load before it loads."""

from __future__ import annotations

from pathlib import Path

from cpud.doctor.planning import Failed, Planning
from cpud.doctor.report import Check, gib


def _gguf_details(path: Path) -> tuple[dict[str, object], tuple[str, ...]]:
    from cpud.model.gguf_model import read_gguf_model

    model = read_gguf_model(path)
    counts: dict[str, int] = {}
    for info in model.tensors.values():
        counts[info.type] = counts.get(info.type, 0) + 1
    by_type = sorted(model.bytes_by_type().items(), key=lambda item: -item[1])
    value = {
        "format": "gguf",
        "gguf_architecture": model.architecture,
        "file_bytes": path.stat().st_size,
        "tensor_types": {name: {"tensors": counts[name], "bytes": n} for name, n in by_type},
    }
    details = tuple(
        f"{name}: {counts[name]} tensor{'s' * (counts[name] != 1)}, {gib(n)}" for name, n in by_type
    )
    return value, details


def _weight_rows(config: object, path: Path) -> tuple[list[dict[str, object]], tuple[str, ...]]:
    """The weight formats and the kernel each linear runs (as the ranks will load them)."""
    from cpud.ranks.quant_plan import weight_formats

    rows = weight_formats(path, config.quantization, config.model)
    value = [{"format": f, "matrices": n, "kernel": k} for f, n, k in rows]
    details = tuple(
        f"{f}: {k}, {n} {'matri' + ('ces' if n != 1 else 'x')}"
        if not f.startswith("embedding")
        else f"{f}: {k}"
        for f, n, k in rows
    )
    return value, details


def model_check(planning: Planning) -> Check:
    config = planning.config
    if isinstance(config, Failed):
        return Check("model", "fail", config.reason, {"error": config.reason}, (config.reason,))
    model = config.model
    path = Path(config.model_dir)
    shape = (
        f"{model.architecture}: {model.num_layers} layers, hidden {model.hidden_size}, "
        f"{model.num_heads} heads / {model.num_kv_heads} KV heads, vocab {model.vocab_size}"
    )
    if model.is_moe:
        shape += (
            f", {model.num_experts} experts of intermediate {model.moe_intermediate_size}"
            f" (top {model.num_experts_per_tok})"
        )
    recipe = model.recipe.describe() if model.recipe is not None else "its own model (per-op path)"
    value: dict[str, object] = {
        "path": str(path),
        "architecture": model.architecture,
        "family": model.family,
        "recipe": recipe,
        "layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "vocab_size": model.vocab_size,
        "checkpoint_dtype": model.checkpoint_dtype,
        "dtype": config.dtype,
        "quantization": config.quantization,
    }
    if model.is_moe:
        value["experts"] = model.num_experts
        value["experts_per_token"] = model.num_experts_per_tok
    details: tuple[str, ...] = ()
    if path.suffix.lower() == ".gguf":
        gguf_value, details = _gguf_details(path)
        value |= gguf_value
        summary = f"{path.name} (GGUF, {gib(value['file_bytes'])}): {shape}; runs in {config.dtype}"
    else:
        summary = f"{path.name}: {shape}; runs in {config.dtype}"
    details = (f"family {model.family}: {recipe}", *details)
    weights, weight_details = _weight_rows(config, path)
    value["weights"] = weights
    summary += f", --quantization {config.quantization}"
    return Check("model", "ok", summary, value, (), (details[0], *weight_details, *details[1:]))
