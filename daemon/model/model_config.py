"""The parts of a Hugging Face config.json the decoder needs, parsed and checked once."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cpud.errors import ConfigError, one_line

# HF architectures -> the cpud model family that runs them.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Qwen2MoeForCausalLM": "moe",
    "Qwen3MoeForCausalLM": "moe",
    "MixtralForCausalLM": "moe",
    "OPTForCausalLM": "opt",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    norm_eps: float
    tie_word_embeddings: bool
    checkpoint_dtype: str | None
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    hidden_act: str = "silu"
    # Mixture of experts (Qwen3-MoE, Mixtral); num_experts 0: a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # Routing weights rounded to the model dtype before they scale the expert outputs (Qwen3-MoE)
    # or kept fp32 until then (Mixtral).
    router_weights_in_dtype: bool = False
    # Decoder layers with a dense MLP of intermediate_size instead of experts.
    dense_layers: tuple[int, ...] = ()
    # Qwen2-MoE: a dense expert every token runs, scaled by sigmoid(x . shared_expert_gate)
    shared_expert_intermediate_size: int = 0
    # OPT only
    word_embed_proj_dim: int | None = None
    do_layer_norm_before: bool = True
    enable_bias: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def family(self) -> str:
        return ARCHITECTURES[self.architecture]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def moe_layer(self, index: int) -> bool:
        """Whether decoder layer `index` runs experts (else a dense MLP)."""
        return self.is_moe and index not in self.dense_layers

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


def _describe(value: Any) -> str:
    return one_line(repr(value), 60)


def _non_finite(value: Any, where: str = "") -> str | None:
    """Where the first NaN or infinity in a decoded JSON value is, and which, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{where or 'the top level'} is {value}"
    items: Any = ()
    if isinstance(value, dict):
        items = ((f"{where}.{k}" if where else str(k), v) for k, v in value.items())
    elif isinstance(value, list):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(value))
    for path, item in items:
        found = _non_finite(item, path)
        if found is not None:
            return found
    return None


def read_json_object(path: str | Path, finite: bool = True) -> dict[str, Any]:
    """A JSON file that must hold an object: UTF-8, valid JSON and (with `finite`) free of NaN
    and infinities (Python's json accepts those; JSON does not). ConfigError names the file."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError(f"{path} cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path} is not UTF-8 text (bad byte at offset {exc.start}): not a JSON file"
        ) from None
    try:
        value = json.loads(text)
        bad = _non_finite(value) if finite else None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{path} is not valid JSON: nested too deeply") from None
    if not isinstance(value, dict):
        kind = {list: "list", str: "string"}.get(type(value), type(value).__name__)
        raise ConfigError(f"{path} holds a JSON {kind}, not an object")
    if bad is not None:
        raise ConfigError(f"{path}: {bad}, not a finite number (JSON has no NaN or Infinity)")
    return value


_REQUIRED = object()
MAX_SIZE = 2**31 - 1
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_int(value: Any) -> bool:
    """A JSON integer: an int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


class _Fields:
    """Typed reads of config.json keys; a missing or null key takes the default."""

    def __init__(self, raw: dict[str, Any], source: str, arch: str, prefix: str = ""):
        self.raw, self.source, self.arch, self.prefix = raw, source, arch, prefix

    def error(self, key: str, wanted: str, value: Any) -> ConfigError:
        where = f"{self.source}: {self.prefix}{key}"
        return ConfigError(f"{where} must be {wanted}, got {_describe(value)}")

    def value(self, key: str, default: Any) -> Any:
        value = self.raw.get(key)
        if value is None:
            if default is _REQUIRED:
                where = f"{self.source}: required key {self.prefix}{key}"
                raise ConfigError(f"{where} is missing for {self.arch}")
            return default
        return value

    def size(self, key: str, default: Any = _REQUIRED, minimum: int = 1) -> int:
        """An integer in [minimum, MAX_SIZE]; integral floats (64.0) are accepted."""
        value = self.value(key, default)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not (is_int(value) and minimum <= value <= MAX_SIZE):
            wanted = "a positive integer" if minimum == 1 else "a non-negative integer"
            raise self.error(key, f"{wanted} (at most {MAX_SIZE})", value)
        return value

    def number(self, key: str, default: Any, high: float = math.inf) -> float:
        """A finite number in (0, high]."""
        value = self.value(key, default)
        if not (_is_number(value) and 0 < value <= high):
            raise self.error(
                key, "a positive number" + (f" <= {high:g}" if high < math.inf else ""), value
            )
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.value(key, default)
        if not isinstance(value, bool):
            raise self.error(key, "true or false", value)
        return value

    def text(self, key: str, default: str | None) -> str | None:
        value = self.value(key, default)
        if value is not None and not isinstance(value, str):
            raise self.error(key, "a string", value)
        return value

    def token_id(self, key: str) -> int | None:
        value = self.value(key, None)
        if value is not None and not is_int(value):
            raise self.error(key, "a token id", value)
        return value

    def token_ids(self, key: str) -> tuple[int, ...]:
        value = self.value(key, None)
        ids = value if isinstance(value, list) else [] if value is None else [value]
        if not all(is_int(v) for v in ids):
            raise self.error(key, "a token id or a list of token ids", value)
        return tuple(ids)


def _rope_scaling(f: _Fields) -> dict[str, Any] | None:
    """rope_scaling (or a non-default rope_parameters) with its type and factors checked."""
    params = f.raw.get("rope_parameters") or {}
    scaling, key = f.raw.get("rope_scaling"), "rope_scaling"
    if scaling is not None and not isinstance(scaling, dict):
        raise f.error(key, "an object or null", scaling)
    if not scaling:
        if params.get("rope_type", "default") == "default":
            return None
        scaling, key = params, "rope_parameters"
    scaling = {k: v for k, v in scaling.items() if v is not None}
    kind = scaling.setdefault("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise f.error(f"{key}.rope_type", f"one of {', '.join(ROPE_TYPES)}", kind)
    if kind == "default":
        return scaling
    sub = _Fields(scaling, f.source, f.arch, prefix=f"{key}.")
    sub.number("factor", _REQUIRED)
    for name in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
        sub.number(name, 1.0)
    sub.flag("truncate", True)
    low, high = sub.number("low_freq_factor", 1.0), sub.number("high_freq_factor", 4.0)
    if kind == "llama3" or "original_max_position_embeddings" in scaling:
        sub.size("original_max_position_embeddings")
    if kind == "llama3":
        if high <= low:
            raise f.error(f"{key}.high_freq_factor", f"above low_freq_factor {low}", high)
    return scaling


def _architecture(raw: dict[str, Any], source: str) -> str:
    archs = raw.get("architectures") or []
    if not isinstance(archs, list):
        raise ConfigError(f"{source}: architectures must be a list, got {_describe(archs)}")
    arch = next((a for a in archs if isinstance(a, str) and a in ARCHITECTURES), None)
    if arch is None:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ConfigError(
            f"{source}: architecture {archs or raw.get('model_type')!r} is not supported "
            f"(supported: {supported})"
        )
    return arch


def _opt_config(f: _Fields, common: dict[str, Any]) -> ModelConfig:
    hidden, heads = common["hidden_size"], common["num_heads"]
    act = f.text("activation_function", "relu")
    if act not in ("relu", "gelu"):
        raise ConfigError(f"{f.source}: OPT activation {act!r} is not supported (relu, gelu)")
    if hidden % heads:
        raise ConfigError(
            f"{f.source}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
        )
    return ModelConfig(
        **common,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=f.size("ffn_dim"),
        max_position_embeddings=f.size("max_position_embeddings"),
        norm_eps=1e-5,
        tie_word_embeddings=f.flag("tie_word_embeddings", True),
        hidden_act=act,
        word_embed_proj_dim=f.size("word_embed_proj_dim", hidden),
        do_layer_norm_before=f.flag("do_layer_norm_before", True),
        enable_bias=f.flag("enable_bias", True),
    )


def parse_model_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """The decoder's settings from a decoded config.json; a ConfigError names the key at fault
    (wrong type, not positive, not finite, or inconsistent with another key)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source} holds a JSON {type(raw).__name__}, not an object")
    arch = _architecture(raw, source)
    f = _Fields(raw, source, arch)
    model_type = f.text("model_type", "") or ""
    hidden, heads = f.size("hidden_size"), f.size("num_attention_heads")
    common: dict[str, Any] = dict(
        architecture=arch,
        model_type=model_type,
        hidden_size=hidden,
        num_layers=f.size("num_hidden_layers"),
        num_heads=heads,
        vocab_size=f.size("vocab_size"),
        checkpoint_dtype=f.text("torch_dtype", None) or f.text("dtype", None),
        bos_token_id=f.token_id("bos_token_id"),
        eos_token_ids=f.token_ids("eos_token_id"),
    )
    if ARCHITECTURES[arch] == "opt":
        return _opt_config(f, common)

    if raw.get("head_dim") is None and hidden % heads:
        raise ConfigError(
            f"{source}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
            f"(and no head_dim is given)"
        )
    head_dim = f.size("head_dim", hidden // heads)
    kv_heads = f.size("num_key_value_heads", heads)
    if heads % kv_heads:
        raise ConfigError(
            f"{source}: num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}"
        )
    partial = f.number("partial_rotary_factor", 1.0, high=1.0)
    rotary_dim = int(head_dim * partial)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ConfigError(
            f"{source}: head_dim {head_dim} x partial_rotary_factor {partial:g} gives a rotary "
            f"dimension of {rotary_dim}, which must be even and at least 2"
        )
    params = f.raw.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise f.error("rope_parameters", "an object or null", params)
    theta = _Fields(params or {}, source, arch, "rope_parameters.").number("rope_theta", 10000.0)
    # transformers' MistralConfig defaults to a 4096 window when the key is absent.
    if "sliding_window" in raw:
        sliding = f.size("sliding_window", 0, minimum=0)
    else:
        sliding = 4096 if model_type == "mistral" else 0
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not f.flag(
        "use_sliding_window", False
    ):
        sliding = 0
    act = f.text("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{source}: hidden_act {act!r} is not supported (silu)")
    attention_bias = f.flag("attention_bias", False)
    moe = _moe_fields(f, arch, common["num_layers"]) if ARCHITECTURES[arch] == "moe" else {}
    return ModelConfig(
        **common,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=f.size("intermediate_size"),
        max_position_embeddings=f.size("max_position_embeddings", 4096),
        norm_eps=f.number("rms_norm_eps", 1e-6),
        tie_word_embeddings=f.flag("tie_word_embeddings", False),
        rope_theta=f.number("rope_theta", theta),
        rope_scaling=_rope_scaling(f),
        partial_rotary_factor=partial,
        qkv_bias=arch == "Qwen2ForCausalLM"
        or (arch == "Qwen2MoeForCausalLM" and f.flag("qkv_bias", True))
        or attention_bias,
        o_bias=attention_bias,
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        sliding_window=sliding or None,
        hidden_act=act,
        **moe,
    )


def _moe_fields(f: _Fields, arch: str, num_layers: int) -> dict[str, Any]:
    """Expert count, routing and which layers stay dense, checked against each other."""
    # transformers 5 writes num_local_experts for Qwen3-MoE too; published configs say num_experts
    experts = f.size("num_local_experts" if f.raw.get("num_experts") is None else "num_experts")
    top_k = f.size("num_experts_per_tok")
    if top_k > experts:
        raise f.error("num_experts_per_tok", f"at most the {experts} experts", top_k)
    if arch == "MixtralForCausalLM":
        return dict(
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=f.size("intermediate_size"),
            norm_topk_prob=True,
        )
    step = f.size("decoder_sparse_step", 1)
    only = f.value("mlp_only_layers", [])
    if not isinstance(only, list) or not all(is_int(i) and 0 <= i < num_layers for i in only):
        raise f.error("mlp_only_layers", f"a list of layer indices below {num_layers}", only)
    dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    shared = f.size("shared_expert_intermediate_size") if arch == "Qwen2MoeForCausalLM" else 0
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=f.size("moe_intermediate_size"),
        norm_topk_prob=f.flag("norm_topk_prob", False),
        router_weights_in_dtype=True,
        dense_layers=dense,
        shared_expert_intermediate_size=shared,
    )
