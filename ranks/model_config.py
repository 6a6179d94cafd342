"""The parts of a Hugging Face config.json the decoder needs, parsed and checked once."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cpud.errors import ConfigError

# HF architectures -> the cpud model family that runs them.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
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
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ConfigError(f"model directory {model_dir} does not exist")
    if not path.is_file():
        raise ConfigError(f"{path} is missing: a model directory needs a Hugging Face config.json")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    return parse_model_config(raw, source=str(path))


def parse_model_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ConfigError(
            f"{source}: architecture {archs or raw.get('model_type')!r} is not supported "
            f"(supported: {supported})"
        )

    def need(key: str) -> Any:
        if key not in raw:
            raise ConfigError(f"{source}: required key {key!r} is missing for {arch}")
        return raw[key]

    model_type = raw.get("model_type", "")
    if ARCHITECTURES[arch] == "opt":
        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        act = raw.get("activation_function", "relu")
        cfg = ModelConfig(
            architecture=arch,
            model_type=model_type,
            hidden_size=hidden,
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=hidden // heads,
            intermediate_size=int(need("ffn_dim")),
            vocab_size=int(need("vocab_size")),
            max_position_embeddings=int(need("max_position_embeddings")),
            norm_eps=1e-5,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
            checkpoint_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            hidden_act=act,
            word_embed_proj_dim=int(raw.get("word_embed_proj_dim") or hidden),
            do_layer_norm_before=bool(raw.get("do_layer_norm_before", True)),
            enable_bias=bool(raw.get("enable_bias", True)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_ids(raw.get("eos_token_id")),
        )
        if act not in ("relu", "gelu"):
            raise ConfigError(f"{source}: OPT activation {act!r} is not supported (relu, gelu)")
        if hidden % heads:
            raise ConfigError(f"{source}: hidden_size {hidden} is not a multiple of {heads} heads")
        return cfg

    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    head_dim = raw.get("head_dim") or hidden // heads
    rope_params = raw.get("rope_parameters") or {}
    rope_scaling = raw.get("rope_scaling") or None
    if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
        rope_scaling = dict(rope_params)
    if rope_scaling is not None:
        rope_scaling = dict(rope_scaling)
        rope_scaling.setdefault("rope_type", rope_scaling.get("type", "default"))
    # transformers' MistralConfig defaults to a 4096 window when the key is absent.
    sliding = raw.get("sliding_window", 4096 if model_type == "mistral" else None)
    if model_type in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        sliding = None
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{source}: hidden_act {act!r} is not supported (silu)")
    return ModelConfig(
        architecture=arch,
        model_type=model_type,
        hidden_size=hidden,
        num_layers=int(need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        intermediate_size=int(need("intermediate_size")),
        vocab_size=int(need("vocab_size")),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        checkpoint_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        rope_theta=float(raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
        rope_scaling=rope_scaling,
        partial_rotary_factor=float(raw.get("partial_rotary_factor", 1.0)),
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
        o_bias=bool(raw.get("attention_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        sliding_window=int(sliding) if sliding else None,
        hidden_act=act,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw.get("eos_token_id")),
    )
