"""The parts of a Hugging Face config.json the decoder needs, parsed and checked once."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cpud.model.moe_recipe import MoeRecipe
from cpud.model.recipe import DecoderRecipe, LayerRecipe, Rope
from cpud.settings.errors import ConfigError, one_line


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str  # the registered family that runs it (ranks/models/registry.py)
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
    # The expert layers' router, biases and activation (None: from the two fields above)
    moe: MoeRecipe | None = None
    # OPT only
    word_embed_proj_dim: int | None = None
    do_layer_norm_before: bool = True
    enable_bias: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # What the decoder layers compute (None: a family with its own model, such as OPT)
    recipe: DecoderRecipe | None = None
    generates: bool = True  # False: an encoder-only embedding model (its family says so)
    # Embeddings as the model declares them (sentence-transformers files, GGUF pooling_type):
    # "last", "mean" or "cls"; None: not declared (see embedding_pooling)
    pooling: str | None = None
    normalize: bool = False
    # BERT-style encoders: token type embeddings and LayerNorm'd absolute position embeddings
    type_vocab_size: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def moe_recipe(self) -> MoeRecipe:
        """What the expert layers compute: `moe`, else the softmax router with
        norm_topk_prob and router_weights_in_dtype."""
        if self.moe is not None:
            return self.moe
        return MoeRecipe(
            renormalize=self.norm_topk_prob, weights_in_dtype=self.router_weights_in_dtype
        )

    def moe_layer(self, index: int) -> bool:
        """Whether decoder layer `index` runs experts (else a dense MLP)."""
        return self.is_moe and index not in self.dense_layers

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def embedding_pooling(self) -> tuple[str, bool]:
        """(pooling, normalise) of this model's embeddings: the declared pooling, else CLS for an
        encoder and the last token for a decoder, normalised (vLLM's defaults)."""
        if self.pooling is not None:
            return self.pooling, self.normalize
        return ("last" if self.generates else "cls"), True


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


REQUIRED = object()
MAX_SIZE = 2**31 - 1
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "su")  # su: longrope's old name


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_int(value: Any) -> bool:
    """A JSON integer: an int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


class ConfigFields:
    """Typed reads of config.json keys; a missing or null key takes the default."""

    def __init__(self, raw: dict[str, Any], source: str, arch: str, prefix: str = ""):
        self.raw, self.source, self.arch, self.prefix = raw, source, arch, prefix

    def error(self, key: str, wanted: str, value: Any) -> ConfigError:
        where = f"{self.source}: {self.prefix}{key}"
        return ConfigError(f"{where} must be {wanted}, got {_describe(value)}")

    def value(self, key: str, default: Any) -> Any:
        value = self.raw.get(key)
        if value is None:
            if default is REQUIRED:
                where = f"{self.source}: required key {self.prefix}{key}"
                raise ConfigError(f"{where} is missing for {self.arch}")
            return default
        return value

    def size(self, key: str, default: Any = REQUIRED, minimum: int = 1) -> int:
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


def _longrope(f: ConfigFields, sub: ConfigFields, scaling: dict[str, Any], rotary_dim: int) -> None:
    """LongRoPE's factor lists checked (`rotary_dim` / 2 positive numbers each; 0: length not
    known here), its original length and factor filled in as transformers derives them."""
    half = rotary_dim // 2
    for name in ("short_factor", "long_factor"):
        value = sub.value(name, REQUIRED)
        if not (isinstance(value, list) and value and all(_is_number(v) and v > 0 for v in value)):
            raise sub.error(name, "a list of positive numbers", value)
        if half and len(value) != half:
            raise sub.error(
                name, f"a list of {half} numbers (half the rotary dimension {rotary_dim})", value
            )
    # The config's own original_max_position_embeddings wins over rope_scaling's (transformers'
    # standardize_rope_params); factor defaults to max_position_embeddings over it.
    if f.raw.get("original_max_position_embeddings") is not None:
        original = f.size("original_max_position_embeddings")
    else:
        original = sub.size("original_max_position_embeddings")
    scaling["original_max_position_embeddings"] = original
    longest = f.size("max_position_embeddings", 4096)
    scaling["factor"] = sub.number("factor", longest / original)
    sub.number("attention_factor", 1.0)


def rope_scaling(f: ConfigFields, rotary_dim: int = 0) -> dict[str, Any] | None:
    """rope_scaling (or a non-default rope_parameters) with its type and factors checked;
    `rotary_dim`: the rotating dimensions of a head, when known (LongRoPE's list lengths)."""
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
    sub = ConfigFields(scaling, f.source, f.arch, prefix=f"{key}.")
    if kind in ("longrope", "su"):
        scaling["rope_type"] = "longrope"
        _longrope(f, sub, scaling, rotary_dim)
        return scaling
    sub.number("factor", REQUIRED)
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


def common_fields(f: ConfigFields, architecture: str, family: str) -> dict[str, Any]:
    """The fields every family's config.json states the same way."""
    return dict(
        architecture=architecture,
        family=family,
        model_type=f.text("model_type", "") or "",
        hidden_size=f.size("hidden_size"),
        num_layers=f.size("num_hidden_layers"),
        num_heads=f.size("num_attention_heads"),
        vocab_size=f.size("vocab_size"),
        checkpoint_dtype=f.text("torch_dtype", None) or f.text("dtype", None),
        bos_token_id=f.token_id("bos_token_id"),
        eos_token_ids=f.token_ids("eos_token_id"),
    )


def decoder_fields(
    f: ConfigFields, common: dict[str, Any], activations: tuple[str, ...] = ("silu",)
) -> dict[str, Any]:
    """The fields of a Llama-shaped decoder's config.json (GQA, RoPE, RMSNorm, gated MLP), read
    and checked against each other; a family adds or overrides its own."""
    source, arch = f.source, f.arch
    hidden, heads = common["hidden_size"], common["num_heads"]
    if f.raw.get("head_dim") is None and hidden % heads:
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
    theta = ConfigFields(params or {}, source, arch, "rope_parameters.").number(
        "rope_theta", 10000.0
    )
    act = f.text("hidden_act", activations[0])
    if act not in activations:
        raise ConfigError(
            f"{source}: hidden_act {act!r} is not supported ({', '.join(activations)})"
        )
    attention_bias = f.flag("attention_bias", False)
    return dict(
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=f.size("intermediate_size"),
        max_position_embeddings=f.size("max_position_embeddings", 4096),
        norm_eps=f.number("rms_norm_eps", 1e-6),
        tie_word_embeddings=f.flag("tie_word_embeddings", False),
        rope_theta=f.number("rope_theta", theta),
        rope_scaling=rope_scaling(f, rotary_dim),
        partial_rotary_factor=partial,
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        sliding_window=f.size("sliding_window", 0, minimum=0) or None,
        hidden_act=act,
    )


def standard_recipe(fields: dict[str, Any], **changes: Any) -> DecoderRecipe:
    """The recipe of a Llama-shaped decoder with these config fields: one RoPE table, the
    same window on every layer, 1/sqrt(head_dim) scaling; `changes` override recipe fields."""
    window = fields.get("sliding_window") or 0
    head_dim = fields["head_dim"]
    recipe = dict(
        layers=tuple(LayerRecipe(window=window) for _ in range(fields["num_layers"])),
        ropes=(Rope(fields.get("rope_theta", 10000.0), fields.get("rope_scaling")),),
        attention_scale=head_dim**-0.5,
        qk_norm=fields.get("qk_norm", False),
        rotary_dim=int(head_dim * fields.get("partial_rotary_factor", 1.0)),
        qkv_bias=fields.get("qkv_bias", False),
        o_bias=fields.get("o_bias", False),
    )
    recipe.update(changes)
    return DecoderRecipe(**recipe)


def decoder_config(fields: dict[str, Any], **recipe_changes: Any) -> ModelConfig:
    """A ModelConfig from a family's fields, with the standard recipe (`recipe_changes` apply)."""
    return ModelConfig(**fields, recipe=standard_recipe(fields, **recipe_changes))
