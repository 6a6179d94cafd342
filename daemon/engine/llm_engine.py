"""The engine loop: add requests, step (schedule -> run -> postprocess), collect outputs.

Generation requests sample tokens; embedding requests run their whole prompt in one step of
the same batch and end with the pooled vector the ranks return.

A failure that belongs to one request (its plan, its text, its logprobs) ends that request
only: it is aborted and its error filed for the caller; a failure of the step itself (the
executor, a rank) propagates.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter

from cpud.engine.admission import Admission
from cpud.engine.block_manager import BlockManager
from cpud.engine.detokenizer import IncrementalDetokenizer
from cpud.engine.embedding import check_embedding_prompt, embedding_uses_kv, vector_from_bytes
from cpud.engine.executor import Executor
from cpud.engine.output_builder import OutputBuilder
from cpud.engine.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from cpud.engine.request import Request
from cpud.engine.request_checks import check_request
from cpud.engine.sampling_params import SamplingParams
from cpud.engine.scheduler import Scheduler, SchedulerOutput
from cpud.engine.sequence import Sequence
from cpud.engine.spec_decode import spec_decoder
from cpud.engine.step_planner import StepPlanner, derive_seed, end_tokens
from cpud.protocol.step import (
    Embedding,
    SampledToken,
    StepPlan,
    StepResult,
    wire_error,
)
from cpud.settings.config import EngineConfig
from cpud.settings.errors import CpudError, RequestError, one_line
from cpud.structured.compiler import GrammarCompiler
from cpud.structured.limits import GrammarLimits
from cpud.text.tokenizer import Tokenizer

log = logging.getLogger("cpud.engine")


class RequestFailedError(CpudError):
    """Serving one request failed inside the engine; the engine goes on with the others."""


def describe(exc: BaseException) -> str:
    """`Type: message` on one short line, whatever the exception holds."""
    try:
        text = one_line(str(exc), 200)
    except Exception:
        text = ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def end_token_ids(config: EngineConfig, tokenizer: Tokenizer) -> frozenset[int]:
    """The tokens that end a sequence: the tokenizer's, else the model config's."""
    return frozenset(tokenizer.eos_token_ids or config.model.eos_token_ids)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer,
        executor: Executor,
        grammars: GrammarCompiler | None = None,
    ):
        """grammars: a compiler for this tokenizer already converting it (a server starts one
        while its ranks load); None builds one with the default limits."""
        self.config = config
        self.tokenizer = tokenizer
        self.executor = executor
        self.blocks = BlockManager(
            config.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.spec = spec_decoder(config)
        self.scheduler = Scheduler(
            self.blocks,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            embeddings_use_kv=embedding_uses_kv(config.model),
            proposer=self.spec.propose if self.spec is not None else None,
        )
        self.requests: dict[str, Request] = {}
        self.seqs: dict[int, Sequence] = {}
        self.eos_token_ids = end_token_ids(config, tokenizer)
        if grammars is None:
            grammars = GrammarCompiler(tokenizer, self.eos_token_ids, GrammarLimits())
            grammars.prepare_in_background()
        self.grammars = grammars
        self.outputs = OutputBuilder(tokenizer)
        self._seq_ids = itertools.count()
        self.planner = StepPlanner(self.spec, self.eos_token_ids)
        # False (the offline API): step() raises a request's failure once it is cleaned up.
        # True (the server): failures are filed in `failures` and the step goes on.
        self.isolate_requests = False
        self.failures: list[tuple[str, Exception]] = []

    # ---- requests -------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> Admission:
        """Checks a request against the model, once; RequestError for what does not fit. The
        result carries what the checks worked out (the output budget, the compiled grammar)
        to `admit`. Thread-safe: the server runs it before the request reaches the engine
        thread, in a worker thread when it compiles a grammar."""
        return check_request(self.config, self.grammars, prompt_token_ids, params)

    def validate_embedding(self, prompt_token_ids: list[int], param: str = "input") -> Admission:
        """Checks an embedding request against the engine (RequestError when its prompt cannot
        run in one step); thread-safe, as `validate`."""
        check_embedding_prompt(self.config, prompt_token_ids, param)
        return Admission(tuple(prompt_token_ids), SamplingParams(), 0, embed=True)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> None:
        """Check and admit a request, or raise (RequestError for its own faults) and change
        nothing."""
        self.admit(request_id, self.validate(prompt_token_ids, params), prompt)

    def admit(self, request_id: str, admission: Admission, prompt: str | None = None) -> None:
        """Admit a request `validate` passed, or raise (RequestError for its own faults) and
        change nothing."""
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use", param="request_id")
        params, prompt_token_ids = admission.params, admission.prompt_token_ids
        if admission.embed:
            self._admit_embedding(Request(request_id, prompt, list(prompt_token_ids), []))
            return
        seqs = []
        for index in range(params.n):
            seed = None
            if params.seed is not None:
                seed = params.seed if params.n == 1 else derive_seed(params.seed, index)
            detok = IncrementalDetokenizer(
                self.tokenizer,
                params.stop,
                params.include_stop_str_in_output,
                params.skip_special_tokens,
            )
            seq = Sequence(
                next(self._seq_ids),
                request_id,
                index,
                list(prompt_token_ids),
                params,
                detok,
                seed,
                max_tokens=admission.max_tokens,
            )
            if admission.grammar is not None:
                seq.constraint = admission.grammar.constraint()
            new, work = self.planner.new_seq(seq, 0), self.planner.work(seq, 0, 0, True)
            why = wire_error(new) or wire_error(work)
            if why is not None:
                raise RequestError(
                    f"the request's sampling settings cannot be sent to the model ranks ({why}): "
                    "bring its numbers into range",
                )
            seqs.append(seq)
        self.requests[request_id] = Request(request_id, prompt, list(prompt_token_ids), seqs)
        if params.structured is not None:
            self.grammars.count_request(params.structured.kind)
        for seq in seqs:
            self.seqs[seq.seq_id] = seq
            self.scheduler.add(seq)

    def _admit_embedding(self, request: Request) -> None:
        """An embedding request: one sequence that samples nothing."""
        seq = Sequence(
            next(self._seq_ids),
            request.request_id,
            0,
            list(request.prompt_token_ids),
            SamplingParams(),
            IncrementalDetokenizer(self.tokenizer),
            None,
            embed=True,
        )
        request.seqs.append(seq)
        self.requests[request.request_id] = request
        self.seqs[seq.seq_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is; its KV blocks are freed at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.finished:
                seq.finish_reason = "abort"
                self._release(seq)
            self.seqs.pop(seq.seq_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def take_failures(self) -> list[tuple[str, Exception]]:
        """(request id, error) of the requests that failed since the last call."""
        failures, self.failures = self.failures, []
        return failures

    def _fail(self, request_id: str, exc: Exception, doing: str) -> None:
        """End one request for a failure of its own; the engine goes on."""
        log.error("request %s failed while %s: %s", request_id, doing, describe(exc))
        log.debug("request %s failure", request_id, exc_info=exc)
        self.abort(request_id)
        if not isinstance(exc, RequestError):
            exc = RequestFailedError(
                f"the request failed inside the engine while {doing} ({type(exc).__name__}); "
                "the server logged it"
            )
        self.failures.append((request_id, exc))

    def _fail_planning(self, seq: Sequence, exc: Exception) -> None:
        self._fail(seq.request_id, exc, "planning its step")

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        """One forward pass over what the scheduler picked; per touched request, an output
        holding what is new since its last one (outputs.OutputAccumulator makes whole ones)."""
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            if self.scheduler.waiting and not self.scheduler.running:
                # Validation guarantees a lone request fits; reaching here is a bug, not load.
                raise RuntimeError("scheduler made no progress with an idle engine")
            return []
        for seq in sched.preempted:  # recomputed later as a sequence the ranks start again
            self.planner.forget(seq)
        plan = self.planner.plan(sched, self.seqs, self._fail_planning)
        result = self._execute(plan) if plan.seqs else None
        if result is None:
            return self._end_step([])
        self.planner.sent(plan, self.seqs)
        touched: dict[str, Request] = {}
        for item in sched.scheduled:
            seq = item.seq
            if seq.finished:  # its request failed while planning
                continue
            seq.num_computed_tokens += item.num_tokens - len(item.draft)
            if not seq.embed:
                self.blocks.cache_computed(seq.blocks, seq.token_ids, seq.num_computed_tokens)
        embedded = self._take_embeddings(sched, result.embeddings)
        for scored in result.prompt_logprobs:
            seq = self.seqs.get(scored.seq_id)
            if seq is None or seq.finished:
                continue
            try:
                self.outputs.add_prompt(seq, scored)
            except Exception as exc:
                self._fail(seq.request_id, exc, "reading its prompt logprobs")
        for sampled in result.tokens:
            seq = self.seqs.get(sampled.seq_id)
            if seq is None or seq.finished:
                continue
            try:
                self._append(seq, sampled)
            except Exception as exc:
                self._fail(seq.request_id, exc, "reading its new token")
                continue
            touched[seq.request_id] = self.requests[seq.request_id]
        if self.spec is not None:
            self._take_verified(sched, result)
        outputs: list[RequestOutput | EmbeddingRequestOutput] = embedded
        for request in touched.values():
            if request.request_id not in self.requests:  # failed after another choice advanced
                continue
            if request.awaits_prompt_logprobs:  # its news waits in its sequences until then
                continue
            try:
                output = self.outputs.output(request)
            except Exception as exc:
                self._fail(request.request_id, exc, "building its output")
                continue
            if output is not None:
                outputs.append(output)
            if request.finished:
                self.requests.pop(request.request_id, None)
                for seq in request.seqs:
                    self.seqs.pop(seq.seq_id, None)
        return self._end_step(outputs)

    def _take_embeddings(
        self, sched: SchedulerOutput, embeddings: list[Embedding]
    ) -> list[EmbeddingRequestOutput]:
        """Finish each embedding request of the step with its vector; its KV blocks are freed
        (no prefix-cache entry kept). One the ranks returned no vector for fails."""
        vectors = {e.seq_id: e.vector for e in embeddings}
        outputs = []
        for item in sched.scheduled:
            seq = item.seq
            if not seq.embed or seq.finished:
                continue
            try:
                vector = vectors.get(seq.seq_id)
                if vector is None:
                    raise RuntimeError("the ranks returned no embedding for it")
                seq.embedding = vector_from_bytes(vector)
            except Exception as exc:
                self._fail(seq.request_id, exc, "reading its embedding")
                continue
            seq.finish_reason = "stop"
            self._release(seq)
            request = self.requests.pop(seq.request_id)
            self.seqs.pop(seq.seq_id, None)
            output = EmbeddingOutput(seq.embedding)
            outputs.append(EmbeddingRequestOutput(request.request_id, output, seq.prompt_token_ids))
        return outputs

    def _take_verified(self, sched: SchedulerOutput, result: StepResult) -> None:
        """Count what the ranks accepted of each proposing sequence; its accepted proposals
        are computed positions now (the rest are rewound on the ranks next step)."""
        emitted = Counter(token.seq_id for token in result.tokens)
        for item in sched.scheduled:
            if not item.draft:
                continue
            seq = item.seq
            accepted = min(len(item.draft), max(0, emitted[seq.seq_id] - 1))
            self.spec.record(seq.seq_id, len(item.draft), accepted)
            if not seq.finished:
                seq.num_computed_tokens += accepted
                self.blocks.cache_computed(seq.blocks, seq.token_ids, seq.num_computed_tokens)

    def _end_step(self, outputs: list) -> list:
        if self.failures and not self.isolate_requests:
            _, error = self.failures[0]
            self.failures = []
            raise error
        return outputs

    def _execute(self, plan: StepPlan) -> StepResult | None:
        """The executor's result; None when the plan could not be encoded because of requests
        of its own, which are failed. Encoding precedes sending, so no rank has the plan and
        the others are simply planned again next step (as sequences the ranks start again:
        an in-process rank may have taken part of the plan)."""
        try:
            return self.executor.execute(plan)
        except CpudError:
            raise
        except Exception as exc:
            items = [*plan.new_seqs, *plan.seqs]
            culprits = {w.seq_id for w in items if wire_error(w, check_ranges=False)}
            if not culprits:
                raise
            self.planner.unsent(plan, self.seqs)
            for seq_id in culprits:
                seq = self.seqs.get(seq_id)
                if seq is not None:
                    self._fail(seq.request_id, exc, "sending its step to the ranks")
            return None

    def _append(self, seq: Sequence, sampled: SampledToken) -> None:
        token = sampled.token_id
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        self.outputs.add_sampled(seq, sampled)
        if seq.constraint is not None:
            seq.constraint.advance(token)
        params = seq.params
        may_stop = seq.num_output_tokens >= params.min_tokens
        eos = token in end_tokens(params, self.eos_token_ids)
        if may_stop and (eos or token in params.stop_token_ids):
            if params.include_stop_str_in_output:  # its text, unless skip_special_tokens drops it
                seq.detokenizer.add(token, check_stop=False)
            self._finish(seq, "stop", None if eos else token)
            return
        stop = seq.detokenizer.add(token, check_stop=may_stop)
        if stop is not None:
            self._finish(seq, "stop", stop)
        elif seq.constraint is not None and seq.constraint.complete:
            self._finish(seq, "stop", None)  # the grammar allows nothing but end of sequence
        elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.config.max_model_len:
            self._finish(seq, "length", None)

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        if not isinstance(stop_reason, str):
            seq.detokenizer.flush()
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        """Finish a sequence in the scheduler (its blocks freed); the ranks drop it next step."""
        self.scheduler.finish(seq)
        self.planner.forget(seq)
        if self.spec is not None:
            self.spec.forget(seq.seq_id)
