"""Engine settings: what the user asked for (EngineArgs) resolved once into a frozen config."""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from cpud import settings
from cpud.model.cpu_features import resolve_dtype
from cpud.model.load import config_from_facts, load_model_config, model_facts
from cpud.model.model_config import ModelConfig, read_json_object
from cpud.model.safetensors_check import check_weights
from cpud.model.sizes import check_kv_cache_dtype, kv_block_bytes
from cpud.process.user_files import check_model_files_are_regular
from cpud.protocol.launch import EngineSpec
from cpud.settings import (
    DEFAULT_KV_CACHE_SPACE_GIB,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    ENGINE,
    MAX_MODEL_LEN_CAP,
    SERVE,
    envs,
)
from cpud.settings.cors_policy import CorsPolicy
from cpud.settings.errors import ConfigError
from cpud.settings.flags import engine_kwargs as engine_kwargs  # parsed flags -> EngineArgs
from cpud.settings.kv_events_config import KVEventsConfig
from cpud.settings.speculative import parse_speculative_config
from cpud.structured.limits import GrammarLimits

GiB = 1 << 30
KERNEL_KINDS = settings.choices("kernels")
COLLECTIVES = settings.choices("collective")
_ENGINE = settings.defaults(ENGINE)
_SERVE = settings.defaults(SERVE)


@dataclass(frozen=True)
class EngineArgs:
    """User-facing knobs, each declared (default, flag, meaning) in cpud.settings; None means
    'choose for me'."""

    model: str | os.PathLike | None = _ENGINE["model"]
    dtype: str = _ENGINE["dtype"]
    tp: int = _ENGINE["tp"]
    max_model_len: int | None = _ENGINE["max_model_len"]
    block_size: int = _ENGINE["block_size"]
    kv_cache_dtype: str = _ENGINE["kv_cache_dtype"]
    max_num_seqs: int = _ENGINE["max_num_seqs"]
    max_num_batched_tokens: int | None = _ENGINE["max_num_batched_tokens"]
    enable_prefix_caching: bool = _ENGINE["enable_prefix_caching"]
    kv_cache_space_gib: float | None = _ENGINE["kv_cache_space_gib"]
    kv_cache_fraction: float | None = _ENGINE["kv_cache_fraction"]
    num_kv_blocks: int | None = _ENGINE["num_kv_blocks"]
    seed: int = _ENGINE["seed"]
    kernels: str = _ENGINE["kernels"]
    bind: str | None = _ENGINE["bind"]
    reserved_cpus: int | None = _ENGINE["reserved_cpus"]
    collective: str = _ENGINE["collective"]
    weight_cache: str = _ENGINE["weight_cache"]
    kv_pretouch: bool = _ENGINE["kv_pretouch"]
    quantization: str = _ENGINE["quantization"]
    int8_kernels: bool | None = _ENGINE["int8_kernels"]
    chat_template: str | None = _ENGINE["chat_template"]
    tool_call_parser: str | None = _ENGINE["tool_call_parser"]
    reasoning_parser: str | None = _ENGINE["reasoning_parser"]
    speculative_config: str | dict | None = _ENGINE["speculative_config"]  # JSON text or dict


def _grammar_limits() -> GrammarLimits:
    return GrammarLimits(
        compile_timeout=_SERVE["grammar_compile_timeout"],
        compile_threads=_SERVE["grammar_compile_threads"],
        cache_mib=_SERVE["grammar_cache_mib"],
    )


@dataclass(frozen=True)
class ServeArgs:
    """How `cpud serve` listens, admits, drains and watches its ranks (each setting declared
    in cpud.settings)."""

    host: str = _SERVE["host"]
    port: int = _SERVE["port"]
    api_key: str | None = field(default=_SERVE["api_key"], repr=False)  # never logged or sent
    served_model_names: tuple[str, ...] = ()  # none: the --model value
    drain_timeout: float = _SERVE["drain_timeout"]
    max_waiting: int = _SERVE["max_waiting"]
    metrics_need_key: bool = _SERVE["metrics_need_key"]
    ready_timeout: float = _SERVE["ready_timeout"]
    rank_timeout: float = _SERVE["rank_timeout"]
    step_timeout: float = _SERVE["step_timeout"]
    stall_timeout: float = _SERVE["stall_timeout"]
    enable_prompt_tokens_details: bool = _SERVE["enable_prompt_tokens_details"]
    http2: bool = _SERVE["http2"]
    data_parallel_size: int = _SERVE["data_parallel_size"]
    router: bool = _SERVE["router"]
    router_args: str | None = _SERVE["router_args"]
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)  # off by default
    replica: int | None = None  # the replica this frontend serves (its metrics' label)
    grammar: GrammarLimits = field(default_factory=_grammar_limits)
    cors: CorsPolicy = field(default_factory=CorsPolicy)  # off unless origins are listed

    def __post_init__(self) -> None:
        for name in (
            "drain_timeout",
            "ready_timeout",
            "rank_timeout",
            "step_timeout",
            "stall_timeout",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} must be a positive number of seconds, got {value}")


@dataclass(frozen=True)
class EngineConfig:
    model_dir: Path
    model: ModelConfig
    dtype: str  # torch attribute name: "bfloat16", "float16" or "float32"
    tp: int
    max_model_len: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    num_kv_blocks: int
    seed: int
    kernels: str = _ENGINE["kernels"]
    collective: str = _ENGINE["collective"]
    weight_cache: str | None = None  # directory of packed weight shards; None: off
    kv_pretouch: bool = _ENGINE["kv_pretouch"]
    quantization: str = _ENGINE["quantization"]
    kv_cache_dtype: str = _ENGINE["kv_cache_dtype"]
    speculative_config: str | None = None  # checked JSON (cpud.settings.speculative); None: off

    @property
    def kv_cache_bytes_per_rank(self) -> int:
        return self.num_kv_blocks * (
            kv_block_bytes(self.model, self.tp, self.block_size, self.dtype, self.kv_cache_dtype)
            + self.draft_kv_block_bytes
        )

    @functools.cached_property
    def draft_model(self) -> ModelConfig | None:
        """The speculative draft model's config (every rank runs it); None without one."""
        from cpud.settings.draft_model import draft_model_config

        return draft_model_config(self.speculative_config)

    @property
    def draft_kv_block_bytes(self) -> int:
        """What the draft model's KV adds to each block on each rank (0 without one)."""
        if self.draft_model is None:
            return 0
        from cpud.settings.draft_model import draft_kv_block_bytes

        return draft_kv_block_bytes(
            self.draft_model, self.block_size, self.dtype, self.kv_cache_dtype
        )

    @property
    def weight_bytes_per_rank(self) -> int:
        """One rank's resident weight bytes (quantized matrices at their packed size)."""
        from cpud.placement.memory_plan import quantized_weight_bytes

        target = quantized_weight_bytes(
            self.model, self.dtype, self.tp, self.model_dir, self.quantization
        )
        if self.draft_model is None:
            return target
        from cpud.settings.draft_model import draft_weight_bytes

        return target + draft_weight_bytes(self.speculative_config, self.draft_model, self.dtype)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    def spec(self) -> EngineSpec:
        """This config as it travels to the frontend and the ranks."""
        fields = {name: getattr(self, name) for name in EngineSpec.__struct_fields__}
        model = model_facts(self.model_dir, self.model)
        return EngineSpec(**{**fields, "model_dir": str(self.model_dir), "model": model})


def config_from_spec(spec: EngineSpec) -> EngineConfig:
    """The config a spec carries, with the model facts it carries (else read again from its
    model_dir); no setting is resolved again."""
    fields = {name: getattr(spec, name) for name in EngineSpec.__struct_fields__}
    model_dir = Path(spec.model_dir)
    if spec.model is not None:
        model = config_from_facts(spec.model)
    else:
        model = load_model_config(model_dir)
    return EngineConfig(**{**fields, "model_dir": model_dir, "model": model})


def _positive(name: str, value: int | float | None) -> None:
    if value is not None and (isinstance(value, bool) or value <= 0):
        raise ConfigError(f"{name} must be positive, got {value}")


def check_model_files(model_dir: Path) -> ModelConfig:
    """config.json parsed, safetensors headers checked against their files and the index, and
    the tokenizer's JSON side files readable: a corrupt model is a ConfigError naming the file
    before any rank starts. Reads headers only: milliseconds for any model size. A GGUF file:
    its metadata and tensor headers checked (about 0.5 s for a 50k-token vocabulary)."""
    check_model_files_are_regular(model_dir)
    if model_dir.is_file():
        from cpud.model.gguf_model import gguf_model_config

        return gguf_model_config(model_dir)
    model = load_model_config(model_dir)
    check_weights(model_dir)
    for name in ("tokenizer_config.json", "generation_config.json"):
        if (model_dir / name).is_file():
            read_json_object(model_dir / name, finite=False)
    return model


def resolve_config(args: EngineArgs, model_dir: Path) -> EngineConfig:
    model = check_model_files(Path(model_dir))
    from cpud.text.tokenizer import check_tokenizer

    check_tokenizer(Path(model_dir), args.chat_template)
    for name in ("tp", "block_size", "max_num_seqs", "max_model_len", "max_num_batched_tokens"):
        _positive(name, getattr(args, name))
    _positive("kv_cache_space_gib", args.kv_cache_space_gib)
    _positive("num_kv_blocks", args.num_kv_blocks)
    if Path(model_dir).is_file():
        from cpud.model.gguf_model import check_gguf_split, read_gguf_model

        check_gguf_split(read_gguf_model(model_dir), args.tp)
    if args.block_size % 16:
        raise ConfigError(f"block_size must be a multiple of 16, got {args.block_size}")
    if args.kernels not in KERNEL_KINDS:
        raise ConfigError(f"kernels must be one of {', '.join(KERNEL_KINDS)}, got {args.kernels!r}")
    if args.collective not in COLLECTIVES:
        raise ConfigError(f"collective must be {' or '.join(COLLECTIVES)}, got {args.collective!r}")
    dtype = resolve_dtype(args.dtype, checkpoint_dtype=model.checkpoint_dtype, kernels=args.kernels)
    quantization = resolve_quantization(args, model, Path(model_dir), dtype)
    max_model_len = args.max_model_len or min(model.max_position_embeddings, MAX_MODEL_LEN_CAP)
    if max_model_len > model.max_position_embeddings:
        raise ConfigError(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
            f"{model.max_position_embeddings}: lower --max-model-len"
        )
    batched = args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
    check_kv_cache_dtype(args.kv_cache_dtype)
    speculative = parse_speculative_config(args.speculative_config)
    block_bytes = kv_block_bytes(model, args.tp, args.block_size, dtype, args.kv_cache_dtype)
    if speculative is not None and speculative.uses_draft_model:  # its KV shares the block ids
        from cpud.settings.draft_model import check_draft_model, draft_kv_block_bytes

        draft = check_draft_model(speculative, model, check_model_files)
        block_bytes += draft_kv_block_bytes(draft, args.block_size, dtype, args.kv_cache_dtype)
    blocks_per_seq = -(-max_model_len // args.block_size)
    if args.num_kv_blocks is not None:
        num_blocks = args.num_kv_blocks
    else:
        space = args.kv_cache_space_gib or envs.kv_cache_space_gib() or DEFAULT_KV_CACHE_SPACE_GIB
        num_blocks = int(space * GiB) // block_bytes
        # More blocks than every sequence at full length could use would only hold stale prefixes.
        num_blocks = min(num_blocks, blocks_per_seq * args.max_num_seqs)
        if num_blocks < blocks_per_seq:
            raise ConfigError(
                f"KV cache of {space:g} GiB holds {num_blocks * args.block_size} tokens, "
                f"fewer than max_model_len {max_model_len}: "
                f"raise --kv-cache-space or lower --max-model-len"
            )
    return EngineConfig(
        model_dir=model_dir,
        model=model,
        dtype=dtype,
        tp=args.tp,
        max_model_len=max_model_len,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=batched,
        enable_prefix_caching=args.enable_prefix_caching,
        num_kv_blocks=num_blocks,
        seed=args.seed,
        kernels=args.kernels,
        collective=args.collective,
        weight_cache=resolve_weight_cache(args.weight_cache),
        kv_pretouch=args.kv_pretouch,
        quantization=quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        speculative_config=speculative.to_json() if speculative is not None else None,
    )


def int8_kernels_quantization(int8_kernels: bool) -> str:
    """The --quantization value the deprecated --int8-kernels / --no-int8-kernels means."""
    return "auto" if int8_kernels else "none"


def resolve_quantization(args: EngineArgs, model: ModelConfig, model_dir: Path, dtype: str) -> str:
    """The --quantization value checked against the model (ConfigError in one line)."""
    from cpud.model.quant_check import check_gguf_dense, check_quantization, check_runs_quantized

    value = args.quantization
    if args.int8_kernels is not None:
        value = int8_kernels_quantization(args.int8_kernels)
    check_quantization(model, value, args.tp)
    check_runs_quantized(value, args.kernels, dtype)
    if model_dir.is_file():
        check_gguf_dense(model_dir, value)
    return value


def resolve_weight_cache(value: str) -> str | None:
    """--weight-cache: auto -> $CPUD_CACHE_DIR/packed (~/.cache/cpud/packed), off -> None."""
    from cpud.fixtures.cache import cache_root

    if value == "off":
        return None
    if value == "auto":
        return str(cache_root() / "packed")
    if not value:
        raise ConfigError("weight_cache must be auto, off or a directory, got ''")
    return str(Path(value).expanduser())
