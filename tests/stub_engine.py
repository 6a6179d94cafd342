"""An LLMEngine over a stub forward pass: the engine loop (scheduler, plans, outputs) runs at
full speed with no model, so tests can count what a step costs as sequences grow.

The stub encodes each plan as the multi-process executor sends it (its size is recorded) and
answers each sampling sequence with the next token of a fixed cycle, with made-up logprobs
when the sequence asks for them."""

from __future__ import annotations

import dataclasses
import time

from cpud.engine.llm_engine import LLMEngine
from cpud.protocol.control import encoder
from cpud.protocol.step import SampledToken, SeqWork, StepPlan, StepResult
from cpud.settings.config import EngineConfig
from cpud.text.tokenizer import Tokenizer


class TokenWriter:
    """An executor with no model: its forward pass answers each sampling work of a plan with
    the token `write` picks for it."""

    def execute(self, plan: StepPlan) -> StepResult:
        self.take(plan)
        return StepResult(plan.step_id, [self.write(work) for work in plan.seqs if work.sample])

    def take(self, plan: StepPlan) -> None:
        """Note what the plan says before its works are answered."""

    def write(self, work: SeqWork) -> SampledToken:
        raise NotImplementedError

    def check_health(self) -> None:
        return None

    def rank_stats(self) -> list:
        return []

    def shutdown(self) -> None:
        return None


class StubExecutor(TokenWriter):
    def __init__(self, cycle: list[int]):
        self.cycle = cycle
        self.plan_bytes: list[int] = []  # encoded size of each plan
        self.forward_ns: list[int] = []  # thread CPU time inside the stub forward, per step
        self._counts: dict[int, int] = {}
        self._num_logprobs: dict[int, int] = {}  # per sequence, from its sampling settings

    def execute(self, plan: StepPlan) -> StepResult:
        self.plan_bytes.append(len(encoder.encode(plan)))
        started = time.thread_time_ns()
        result = super().execute(plan)
        self.forward_ns.append(time.thread_time_ns() - started)
        return result

    def take(self, plan: StepPlan) -> None:
        for new in plan.new_seqs:
            self._num_logprobs[new.seq_id] = new.sampling.num_logprobs if new.sampling else -1

    def write(self, work: SeqWork) -> SampledToken:
        k = self._counts.get(work.seq_id, work.seq_id)
        self._counts[work.seq_id] = k + 1
        token = self.cycle[k % len(self.cycle)]
        num = self._num_logprobs.get(work.seq_id, -1)
        if num < 0:
            return SampledToken(work.seq_id, token)
        tops = [self.cycle[(k + j) % len(self.cycle)] for j in range(1, num + 1)]
        values = [-1.0 - j for j in range(num)]
        return SampledToken(work.seq_id, token, -0.5, 1, tops, values)


def stub_engine(
    config: EngineConfig, tokenizer: Tokenizer, text: str, max_len: int, seqs: int
) -> tuple[LLMEngine, StubExecutor]:
    """An engine of `config`'s model with room for `seqs` sequences of max_len tokens, whose
    forward pass samples the tokens of `text` over and over."""
    config = dataclasses.replace(
        config,
        max_model_len=max_len,
        num_kv_blocks=seqs * (-(-max_len // config.block_size)) + 8,
        max_num_seqs=seqs,
        max_num_batched_tokens=max(config.max_num_batched_tokens, 4 * seqs),
    )
    stub = StubExecutor(tokenizer.encode(text))
    return LLMEngine(config, tokenizer, stub), stub
