"""Parity table (arch x dtype) of cpud against Hugging Face transformers on fixture models.

    python perf/parity_report.py

fp32: greedy tokens (5 prompts of 1..301 tokens, 16 new tokens each, chunked prefill of 24
tokens) compared token by token, and the max prompt-logit difference. bf16: max and mean
|logit - fp32 reference| in units of the reference's standard deviation σ, for cpud and for
transformers' own bf16 path.
"""

from __future__ import annotations

import random
import tempfile

import torch
from transformers import AutoModelForCausalLM

from cpud import LLM, SamplingParams
from cpud.fixtures import ARCHS, make_model
from cpud.protocol.step import SeqWork, StepPlan

LENGTHS = (1, 7, 33, 130, 301)
NEW = 16


@torch.inference_mode()
def hf_greedy(model, prompt: list[int]) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


@torch.inference_mode()
def hf_logits(model, prompt: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([prompt])).logits[0].float()


def cpud_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    blocks = list(range(-(-len(prompt) // llm.config.block_size)))
    plan = StepPlan(0, [SeqWork(0, prompt, 0, blocks, False)])
    return llm.engine.executor.runner.prompt_logits(plan).float()


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHS:
            path = make_model(arch, "tiny", f"{tmp}/{arch}")
            hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
            rng = random.Random(0)
            prompts = [[rng.randrange(4, 500) for _ in range(n)] for n in LENGTHS]
            # min_new_tokens bans EOS in transformers; min_tokens does the same in cpud.
            params = SamplingParams(max_tokens=NEW, min_tokens=NEW, temperature=0)
            llm32 = LLM(path, dtype="float32", max_num_batched_tokens=24)
            ours = [o.outputs[0].token_ids for o in llm32.generate(prompts, params)]
            theirs = [hf_greedy(hf32, p) for p in prompts]
            same = sum(a == b for x, y in zip(ours, theirs) for a, b in zip(x, y))
            probe = prompts[3]
            ref = hf_logits(hf32, probe)
            fp32_err = float((cpud_logits(llm32, probe) - ref).abs().max())
            sigma = float(ref.std())
            ours16 = (cpud_logits(LLM(path, dtype="bfloat16"), probe) - ref).abs() / sigma
            hf16_err = (hf_logits(hf16, probe) - ref).abs() / sigma
            rows.append(
                f"| {arch} | {same}/{NEW * len(prompts)} | {fp32_err:.1e} "
                f"| {ours16.max():.3f}σ / {ours16.mean():.4f}σ "
                f"| {hf16_err.max():.3f}σ / {hf16_err.mean():.4f}σ |"
            )
    print(
        "| arch | fp32 greedy tokens equal | fp32 max logit diff "
        "| bf16 cpud max / mean err | bf16 transformers max / mean err |"
    )
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
