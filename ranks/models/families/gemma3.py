"""Gemma 3 text decoders (Gemma3ForCausalLM, GGUF `gemma3`): five sliding-window layers to one
global, each kind with its own RoPE table (local base 10000 unscaled; global rope_theta with
rope_scaling), attention scaled by query_pre_attn_scalar**-0.5, four "1 + weight" RMSNorms per
layer computed in fp32 (the two sandwich norms among them) and q/k norm, gated GELU-tanh,
embeddings times sqrt(hidden) rounded to the model dtype, tied embeddings, optional final logit
soft-cap.

GGUF files carry less: llama.cpp (src/llama-model.cpp, LLM_ARCH_GEMMA3) hard-codes the pattern
(every 6th layer global) and the local base 10000 when the file names a sliding window, applies
the file's RoPE scaling to the global layers only, and scales attention by head_dim**-0.5, or
(hidden / heads)**-0.5 for the 62-layer 27B; its converter stores the norms as 1 + w already."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cpud.model.model_config import (
    ConfigFields,
    ModelConfig,
    common_fields,
    decoder_fields,
    rope_scaling,
    standard_recipe,
)
from cpud.model.recipe import DecoderRecipe, LayerRecipe, Rope
from cpud.ranks.models.family import Family
from cpud.settings.errors import ConfigError

if TYPE_CHECKING:
    from cpud.model.gguf_meta import GGUFMeta

ARCHITECTURE = "Gemma3ForCausalLM"
SLIDING, FULL = "sliding_attention", "full_attention"
PATTERN = 6  # transformers' sliding_window_pattern default, llama.cpp's set_swa_pattern(6)
LOCAL_BASE = 10000.0
LLAMA_CPP_27B_LAYERS = 62  # llama.cpp scales attention by (hidden / heads)**-0.5 for these

# The turn format of Gemma's instruction-tuned checkpoints (text only), a system message folded
# into the first user turn; for GGUF files that carry no template.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' %}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}"
    "{%- set first_user_prefix = '' %}"
    "{%- set loop_messages = messages %}"
    "{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{- message['content'] | trim }}"
    "{{- '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<start_of_turn>model\\n' }}"
    "{%- endif %}"
)


def _layer_kinds(f: ConfigFields, layers: int) -> list[str]:
    """config.json's layer_types, else the older sliding_window_pattern (every Nth global)."""
    kinds = f.value("layer_types", None)
    if kinds is None:
        key = "_sliding_window_pattern"
        if "sliding_window_pattern" in f.raw:
            key = "sliding_window_pattern"
        pattern = f.size(key, PATTERN)
        return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]
    known = isinstance(kinds, list) and all(k in (SLIDING, FULL) for k in kinds)
    if not known or len(kinds) != layers:
        raise f.error("layer_types", f"a list of {layers} {SLIDING!r} or {FULL!r}", kinds)
    return kinds


def _ropes(f: ConfigFields) -> tuple[Rope, Rope]:
    """(global, local) RoPE tables: transformers 5's rope_parameters per layer kind, or the
    published configs' rope_theta + rope_scaling and rope_local_base_freq."""
    params = f.value("rope_parameters", None)
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        tables = []
        for kind, base in ((FULL, 1_000_000.0), (SLIDING, LOCAL_BASE)):
            sub = params.get(kind) or {}
            if not isinstance(sub, dict):
                raise f.error(f"rope_parameters.{kind}", "an object", sub)
            where = f"rope_parameters.{kind}."
            theta = ConfigFields(sub, f.source, f.arch, where).number("rope_theta", base)
            rest = {k: v for k, v in sub.items() if k != "rope_theta"}
            scaling = rope_scaling(ConfigFields({"rope_scaling": rest}, f.source, f.arch, where))
            if scaling is not None and scaling["rope_type"] == "default":
                scaling = None
            tables.append(Rope(theta, scaling))
        return tables[0], tables[1]
    if params is not None and not isinstance(params, dict):
        raise f.error("rope_parameters", "an object or null", params)
    return (
        Rope(f.number("rope_theta", 1_000_000.0), rope_scaling(f)),
        Rope(f.number("rope_local_base_freq", LOCAL_BASE)),
    )


def _refuse_unsupported(f: ConfigFields) -> None:
    cap = f.value("attn_logit_softcapping", None)
    if cap is not None:
        raise ConfigError(
            f"{f.source}: attn_logit_softcapping is {cap!r}: cpud's decoder has no attention "
            f"logit soft-capping (Gemma 3 checkpoints set it to null; Gemma 2 needs it)"
        )
    if f.flag("use_bidirectional_attention", False):
        raise ConfigError(
            f"{f.source}: use_bidirectional_attention is true (an embedding model): cpud runs "
            f"causal decoders only"
        )


def hf_config(f: ConfigFields, architecture: str) -> ModelConfig:
    _refuse_unsupported(f)
    common = common_fields(f, architecture, "gemma3")
    # Gemma names its activation hidden_activation; a stray hidden_act is not read by it either.
    llama_shaped = ConfigFields(
        {k: v for k, v in f.raw.items() if k != "hidden_act"}, f.source, f.arch
    )
    fields = common | decoder_fields(llama_shaped, common, activations=("gelu_pytorch_tanh",))
    act = f.text("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise f.error("hidden_activation", "'gelu_pytorch_tanh'", act)
    head_dim = f.size("head_dim", 256)
    global_rope, local_rope = _ropes(f)
    window = f.size("sliding_window", 4096)
    kinds = _layer_kinds(f, common["num_layers"])
    fields |= dict(
        head_dim=head_dim,
        tie_word_embeddings=f.flag("tie_word_embeddings", True),
        max_position_embeddings=f.size("max_position_embeddings", 131072),
        rope_theta=global_rope.theta,
        rope_scaling=global_rope.scaling,
        partial_rotary_factor=1.0,
        sliding_window=window,
        hidden_act=act,
        qk_norm=True,
    )
    softcap = f.value("final_logit_softcapping", None)
    layers = tuple(
        LayerRecipe(window=window, rope=1) if kind == SLIDING else LayerRecipe(rope=0)
        for kind in kinds
    )
    return ModelConfig(
        **fields,
        recipe=_recipe(
            fields,
            layers,
            (global_rope, local_rope),
            scale=f.number("query_pre_attn_scalar", 256) ** -0.5,
            norm_offset=1.0,
            softcap=0.0 if softcap is None else f.number("final_logit_softcapping", None),
        ),
    )


def _recipe(
    fields: dict[str, Any],
    layers: tuple[LayerRecipe, ...],
    ropes: tuple[Rope, ...],
    scale: float,
    norm_offset: float,
    softcap: float,
) -> DecoderRecipe:
    """Gemma 3's recipe over these layers and RoPE tables."""
    return standard_recipe(
        fields,
        layers=layers,
        ropes=ropes,
        attention_scale=scale,
        norm="rms_fp32_weight",
        norm_weight_offset=norm_offset,
        sandwich_norms=True,
        activation="gelu_tanh",
        embedding_multiplier=fields["hidden_size"] ** 0.5,
        embedding_multiplier_in_dtype=True,
        final_logit_softcap=softcap,
    )


def gguf_config(m: GGUFMeta) -> ModelConfig:
    """What llama.cpp builds from a `gemma3` file's metadata (see the module doc)."""
    from cpud.model.gguf_meta import decoder_fields as gguf_fields

    fields = gguf_fields(m) | dict(architecture=ARCHITECTURE, family="gemma3", qk_norm=True)
    fields["hidden_act"] = "gelu_pytorch_tanh"
    window = m.get("attention.sliding_window", 0)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise m.error(f"{m.arch}.attention.sliding_window", "a non-negative integer", window)
    window = window or 0
    global_rope = Rope(fields["rope_theta"], fields["rope_scaling"])
    count = fields["num_layers"]
    if window:
        layers = tuple(
            LayerRecipe(rope=0) if (i + 1) % PATTERN == 0 else LayerRecipe(window=window, rope=1)
            for i in range(count)
        )
        ropes: tuple[Rope, ...] = (global_rope, Rope(LOCAL_BASE))
    else:
        layers, ropes = tuple(LayerRecipe() for _ in range(count)), (global_rope,)
    fields["sliding_window"] = window or None
    if count == LLAMA_CPP_27B_LAYERS:
        scale = (fields["hidden_size"] // fields["num_heads"]) ** -0.5
    else:
        scale = fields["head_dim"] ** -0.5
    softcap = m.get("final_logit_softcapping", None)
    return ModelConfig(
        **fields,
        recipe=_recipe(
            fields,
            layers,
            ropes,
            scale=scale,
            norm_offset=0.0,  # llama.cpp's converter stores 1 + w
            softcap=0.0 if softcap is None else m.number("final_logit_softcapping"),
        ),
    )


FAMILY = Family(
    name="gemma3",
    hf_architectures=(ARCHITECTURE,),
    hf_config=hf_config,
    gguf_architectures=("gemma3",),
    gguf_config=gguf_config,
    # Hugging Face's sandwich norms -> cpud's: post_attention_layernorm is on the attention
    # output, pre_feedforward_layernorm is what cpud calls post_attention_layernorm.
    checkpoint_renames=(
        ("post_attention_layernorm", "attn_out_norm"),
        ("pre_feedforward_layernorm", "post_attention_layernorm"),
        ("post_feedforward_layernorm", "ffn_out_norm"),
    ),
    chat_template=CHAT_TEMPLATE,
)
