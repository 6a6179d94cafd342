"""One rank's model: load its shard, own its KV cache, execute step plans."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from cpud.model.model_config import ModelConfig
from cpud.protocol.step import StepPlan, StepResult
from cpud.ranks.fused_decoder import FusedDecoder, unsupported_reason
from cpud.ranks.kv_pretouch import KVPretouch
from cpud.ranks.loader import load_weights
from cpud.ranks.models.build import (
    begin_native_pack,
    build_model,
    finish_native_pack,
    packable_layers,
    packed_shapes,
    packed_weight_names,
)
from cpud.ranks.ops import make_ops
from cpud.ranks.paged_kv import kv_cache_dtype, kv_cache_shape
from cpud.ranks.parallel import TPGroup
from cpud.ranks.pooling import embeddings, pool
from cpud.ranks.sampler import score_prompts
from cpud.ranks.seq_states import SeqStates
from cpud.ranks.spec_draft import DraftProposer
from cpud.ranks.spec_verify import sample_or_verify
from cpud.ranks.step_inputs import StepInputs, build_step_inputs
from cpud.settings import ENGINE, defaults

log = logging.getLogger("cpud.rank")
_ENGINE = defaults(ENGINE)  # defaults of the settings a runner gets resolved


@dataclass(frozen=True)
class RunnerConfig:
    model_dir: Path
    dtype: torch.dtype
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    seed: int = _ENGINE["seed"]
    kernels: str = _ENGINE["kernels"]
    weight_cache: Path | None = None  # directory of packed shards kept between starts
    kv_pretouch: bool = _ENGINE["kv_pretouch"]  # map the KV cache pages while the runner idles
    # native kernels: auto keeps a GGUF file's quantized linears in blocks; q8_0|q4_0|q4_k
    # quantizes dense linears at load (ranks/quantize_dense.py); none runs everything dense
    quantization: str = _ENGINE["quantization"]
    # auto: the KV cache holds dtype; bf16, int8, fp8 (= fp8_e4m3), fp8_e5m2: that format
    # (ranks/paged_kv.py)
    kv_cache_dtype: str = _ENGINE["kv_cache_dtype"]
    # JSON (cpud.settings.speculative); a draft model's runs in this runner (ranks/spec_draft.py)
    speculative_config: str | None = None


class ModelRunner:
    def __init__(
        self,
        config: RunnerConfig,
        model_cfg: ModelConfig,
        group: TPGroup,
        progress: Callable[[int, int], None] | None = None,
    ):
        self.config = config
        self.group = group
        self.ops = make_ops(config.kernels)
        self.model = build_model(model_cfg, config.max_model_len, config.dtype, group, self.ops)
        plan, embedding_blocks = self._quant_plan()
        if self.ops.name == "native" and (config.dtype == torch.bfloat16 or plan):
            self._load_packed(progress, plan, embedding_blocks)
        else:
            load_weights(self.model, config.model_dir, progress)
        self.model.eval()
        self.model_cfg = model_cfg
        # An encoder attends within each step's sequences only: no KV cache.
        self.uses_kv = getattr(self.model, "uses_kv_cache", True)
        cache_dtype = kv_cache_dtype(config.kv_cache_dtype, config.dtype)
        shape = kv_cache_shape(
            config.num_kv_blocks,
            self.model.kv_heads_local,
            config.block_size,
            self.model.head_dim,
            cache_dtype,
        )
        # torch.empty: pages are touched (and so placed) by the rank that writes them.
        self.kv_caches = [
            (torch.empty(shape, dtype=cache_dtype), torch.empty(shape, dtype=cache_dtype))
            for _ in range(model_cfg.num_layers if self.uses_kv else 0)
        ]
        reason = unsupported_reason(self.model, self.ops, group)
        # None: the per-op path (the reference, and what runs where fusing is not supported)
        self.decoder = (
            FusedDecoder(self.model, self.ops, group, self.kv_caches, config.dtype)
            if reason is None
            else None
        )
        if group.rank == 0:
            recipe = model_cfg.recipe.describe() if model_cfg.recipe is not None else "own model"
            how = "fused (one native call per step)" if reason is None else f"op by op: {reason}"
            if not self.uses_kv:
                how = "op by op: an encoder (embeddings only, no KV cache)"
            log.info(
                "model family %s (%s): %s; layers %s",
                model_cfg.family,
                model_cfg.architecture,
                recipe,
                how,
            )
        self._idle_since: float | None = time.monotonic()
        pretouch = config.kv_pretouch and self.uses_kv
        self.kv_pretouch = (
            KVPretouch(self.kv_caches, self.idle_seconds).start() if pretouch else None
        )
        self.generator = torch.Generator().manual_seed(config.seed + group.rank)
        self.seqs = SeqStates()  # what the plans said about each sequence the rank holds
        self.draft = build_draft(config, group.rank)  # speculative decoding's draft, if any

    def _quant_plan(self) -> tuple[dict, bool]:
        """The linears kept quantized (native kernels, bf16 or fp32): a GGUF file's blocks, or
        every linear under a dense --quantization."""
        from cpud.model.quant_check import DENSE_TYPES

        config = self.config
        native = self.ops.name == "native" and config.dtype in (torch.bfloat16, torch.float32)
        if config.quantization in DENSE_TYPES and not native:
            log.warning(
                "--quantization %s needs the native kernels in bf16 or fp32: running dense",
                config.quantization,
            )
        if not native or config.quantization == "none":
            return {}, False
        if config.quantization in DENSE_TYPES:
            from cpud.ranks.quantize_dense import dense_plan

            return dense_plan(self.model, config.quantization), False
        if not config.model_dir.is_file():
            from cpud.ranks.gguf_experts import hf_expert_plans  # MXFP4 experts stay in blocks

            return hf_expert_plans(self.model, config.model_dir), False
        from cpud.ranks.quant_plan import gguf_quant_plan

        return gguf_quant_plan(self.model, config.model_dir)

    def _load_packed(
        self,
        progress: Callable[[int, int], None] | None,
        plan: dict | None = None,
        embedding_blocks: bool = False,
    ) -> None:
        """Load with every matmul weight packed for the native GEMM (bf16 skinny GEMM, or the
        quantized GEMM on the linears in `plan`): mapped from the weight cache when this shard
        is there, else packed while it loads and then written to the cache."""
        from cpud.model.quant_check import DENSE_TYPES
        from cpud.ranks import quantize_dense as qd
        from cpud.ranks.quant_linear import begin_quant, cache_shapes, finish_quant

        config = self.config
        plan = plan or {}
        dense = bool(plan) and config.quantization in DENSE_TYPES
        bf16 = config.dtype == torch.bfloat16
        cache = None
        if config.weight_cache is not None:
            from cpud.native.kernels import GEMM_NB
            from cpud.ranks.weight_cache import ShardIdentity, WeightCache

            identity = ShardIdentity(
                str(config.model_dir.resolve()),
                str(config.dtype),
                self.group.size,
                self.group.rank,
                GEMM_NB,
                config.quantization if dense else "gguf" if plan else "",
            )
            cache = WeightCache(config.weight_cache, identity)
        qshapes = cache_shapes(plan) | (qd.dense_cache_shapes(self.model) if dense else {})
        if dense:
            qd.begin_dense_quant(self.model, plan)
        else:
            begin_quant(self.model, plan, embedding_blocks, cached=False)
        shapes = packed_shapes(self.model) if bf16 else {}
        cached = None
        if cache is not None:
            cached = cache.load(shapes | qshapes, dict.fromkeys(qshapes, torch.uint8))
        if cached is not None and not dense:
            begin_quant(self.model, plan, embedding_blocks, cached=True)
        skip = packed_weight_names(self.model) if cached and bf16 else frozenset()
        if cached and dense:
            skip |= qd.dense_weight_names(self.model, plan)
        if bf16:
            begin_native_pack(self.model, self.ops, cached)
        load_weights(self.model, config.model_dir, progress, skip)
        if dense:
            packed = qd.finish_dense_quant(self.model, plan, cached)
        else:
            packed = finish_quant(self.model, cached)
        layers = packable_layers(self.model)  # now: once packed, a layer no longer counts
        if bf16:
            finish_native_pack(self.model)
        if plan:
            from cpud.ranks.quant_plan import describe_weights

            log.info("rank %d %s", self.group.rank, describe_weights(self.model, self.ops.k.isa))
        if cache is not None and cached is None:
            packed.update(
                (name, layer.packed.data)
                for name, layer in layers.items()
                if layer.packed is not None
            )
            cache.store(packed)

    def idle_seconds(self) -> float:
        """Seconds since the last step ended; 0 while one runs."""
        since = self._idle_since
        return 0.0 if since is None else time.monotonic() - since

    @contextmanager
    def _busy(self) -> Iterator[None]:
        self._idle_since = None
        try:
            yield
        finally:
            self._idle_since = time.monotonic()

    @property
    def helper_threads(self) -> frozenset[int]:
        """Native ids of the runner's helper threads (KV pre-fault), which are not compute."""
        tid = self.kv_pretouch.thread_id if self.kv_pretouch else None
        return frozenset([tid]) if tid is not None else frozenset()

    @property
    def kv_cache_bytes(self) -> int:
        draft = self.draft.kv_cache_bytes if self.draft is not None else 0
        return draft + sum(k.nbytes + v.nbytes for k, v in self.kv_caches)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult | None:
        """Run one step; rank 0 returns the sampled tokens, other ranks None."""
        with self._busy():
            return self._execute(plan)

    def _execute(self, plan: StepPlan) -> StepResult | None:
        started = time.perf_counter()
        inputs, hidden, draft_probs = self._forward(plan)
        tokens = []
        if inputs.sampling_rows:
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            if logits is not None:
                tokens = sample_or_verify(
                    logits, inputs.sampling_rows, self.generator, self.ops.argmax, draft_probs
                )
        scored = []
        if inputs.scoring_works:
            scored = score_prompts(
                self.model.compute_logits,
                hidden,
                inputs.prompt_rows,
                inputs.prompt_targets,
                inputs.scoring_works,
            )
        pooled = None
        if inputs.embed_works:
            pooling, normalize = self.model_cfg.embedding_pooling
            pooled = pool(hidden, inputs.embed_starts, inputs.embed_lens, pooling, normalize)
        if self.group.rank != 0:
            return None
        vectors = embeddings(inputs.embed_works, pooled) if pooled is not None else []
        return StepResult(plan.step_id, tokens, time.perf_counter() - started, scored, vectors)

    @torch.inference_mode()
    def prompt_logits(self, plan: StepPlan) -> torch.Tensor | None:
        """Logits for every token of the plan (tests and prompt logprobs); [T, vocab]."""
        with self._busy():
            return self.model.compute_logits(self._forward(plan)[1])

    def _forward(
        self, plan: StepPlan
    ) -> tuple[StepInputs, torch.Tensor, dict[int, torch.Tensor] | None]:
        """Hidden states of every token of the plan (writes their KV), and a draft model's
        distributions of its sampled proposals by seq_id (its proposals are in the inputs)."""
        held = self.seqs.apply(plan)
        draft_probs = None
        if self.draft is not None:
            plan, draft_probs = self.draft.fill(plan, held)
        inputs = build_step_inputs(plan, held, self.config.block_size, kv=self.uses_kv)
        if not self.uses_kv and len(inputs.embed_works) != len(plan.seqs):
            raise ValueError(
                f"{self.model_cfg.architecture} is an embedding model: every sequence of a step "
                f"must be an embedding sequence"
            )
        if self.decoder is not None:
            hidden = self.decoder.forward(inputs.input_ids, inputs.positions, inputs.meta)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        return inputs, hidden, draft_probs


def build_draft(config: RunnerConfig, rank: int) -> DraftProposer | None:
    """The rank's speculative draft model as config.speculative_config says (None: none): the
    whole model at TP 1, in the target's dtype and kernels, with as many KV blocks as the
    target (ranks/spec_draft.py)."""
    from cpud.settings.speculative import parse_speculative_config

    spec = parse_speculative_config(config.speculative_config)
    if spec is None or not spec.uses_draft_model or spec.model is None:
        return None
    from cpud.model.load import load_model_config
    from cpud.ranks.parallel import SingleRank

    path = Path(spec.model)
    draft_config = replace(
        config,
        model_dir=path,
        quantization=spec.quantization,
        kv_pretouch=False,
        speculative_config=None,
    )
    runner = ModelRunner(draft_config, load_model_config(path), SingleRank())
    if rank == 0:
        log.info(
            "speculative draft %s in every rank: %d proposals per step, KV cache %.1f MiB",
            path,
            spec.num_speculative_tokens,
            runner.kv_cache_bytes / 2**20,
        )
    return DraftProposer(runner, config.seed)
