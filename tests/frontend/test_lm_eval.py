"""lm-eval's `local-completions` model against the daemon, on local task files (the hub is
unreachable): a multiple-choice (loglikelihood) task and a generate_until task, with the
remote tokenizer (/tokenizer_info, /tokenize). The loglikelihoods lm-eval reports must be the
engine's own, computed here with the offline API's prompt_logprobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from cpud import LLM, SamplingParams

MULTIPLE_CHOICE = [
    {"context": "The cat sat on the", "choices": ["mat", "moon", "keyboard"], "label": 0},
    {"context": "Water boils at one hundred", "choices": ["degrees", "apples"], "label": 0},
    {"context": "Q: 2+2=?\nA:", "choices": ["4", "five", "a fish"], "label": 0},
]
QUESTIONS = [
    {"question": "What is two plus two?", "answer": "four"},
    {"question": "Name a colour.", "answer": "red"},
]
MAX_GEN_TOKS = 8

TASKS = {
    "cpud_ll": """
        task: cpud_ll
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {dir}/cpud_ll.jsonl
        test_split: test
        output_type: multiple_choice
        doc_to_text: "{{{{context}}}}"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: "{{{{label}}}}"
        metric_list:
          - metric: acc
            aggregation: mean
            higher_is_better: true
    """,
    "cpud_gen": f"""
        task: cpud_gen
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {{dir}}/cpud_gen.jsonl
        test_split: test
        output_type: generate_until
        doc_to_text: "Q: {{{{question}}}}\\nA:"
        doc_to_target: "{{{{answer}}}}"
        generation_kwargs:
          until: ["\\n"]
          max_gen_toks: {MAX_GEN_TOKS}
          do_sample: false
          temperature: 0
        metric_list:
          - metric: exact_match
            aggregation: mean
            higher_is_better: true
    """,
}

RUNNER = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager

base_url, task_dir, out = sys.argv[1:]
results = lm_eval.simple_evaluate(
    model="local-completions",
    model_args={
        "base_url": base_url + "/v1/completions",
        "model": "tiny",
        "tokenizer_backend": "remote",
        "max_length": 256,
        "max_retries": 1,
    },
    tasks=["cpud_ll", "cpud_gen"],
    task_manager=TaskManager(include_path=task_dir),
    log_samples=True,
)
samples = {
    task: [{"arguments": s["arguments"], "resps": s["resps"]} for s in rows]
    for task, rows in results["samples"].items()
}
json.dump({"samples": samples, "results": results["results"]}, open(out, "w"), default=str)
"""


def write_tasks(directory) -> None:
    for name, rows in (("cpud_ll", MULTIPLE_CHOICE), ("cpud_gen", QUESTIONS)):
        lines = "".join(json.dumps(row) + "\n" for row in rows)
        (directory / f"{name}.jsonl").write_text(lines)
        (directory / f"{name}.yaml").write_text(textwrap.dedent(TASKS[name]).format(dir=directory))


@pytest.fixture(scope="module")
def lm_eval_run(server, tmp_path_factory) -> dict:
    directory = tmp_path_factory.mktemp("lm_eval_tasks")
    write_tasks(directory)
    out = directory / "results.json"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-c", RUNNER, server.base_url, str(directory), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def engine(model_factory):
    return LLM(model_factory("qwen3"), dtype="float32")


def encode_pair(llm: LLM, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's TemplateLM._encode_pair with the served tokenizer (no special tokens)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation = context[-spaces:] + continuation
        context = context[:-spaces]
    whole = llm.tokenizer.encode(context + continuation, add_special_tokens=False)
    context_ids = llm.tokenizer.encode(context, add_special_tokens=False)
    return context_ids, whole[len(context_ids) :]


def test_loglikelihoods_are_the_engines_own(lm_eval_run, engine):
    samples = lm_eval_run["samples"]["cpud_ll"]
    assert len(samples) == len(MULTIPLE_CHOICE)
    requests = [pair for sample in samples for pair in sample["arguments"]]
    reported = [resp[0] for sample in samples for resp in sample["resps"]]
    assert len(requests) == sum(len(doc["choices"]) for doc in MULTIPLE_CHOICE)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    for (context, continuation), (loglikelihood, greedy) in zip(requests, reported):
        context_ids, continuation_ids = encode_pair(engine, context, continuation)
        ids = context_ids + continuation_ids
        entries = engine.generate([ids], params)[0].prompt_logprobs[len(context_ids) :]
        scored = [entry[token] for entry, token in zip(entries, continuation_ids)]
        assert loglikelihood == pytest.approx(sum(lp.logprob for lp in scored), abs=1e-4)
        assert greedy == all(lp.rank == 1 for lp in scored)
    assert "acc,none" in lm_eval_run["results"]["cpud_ll"]


def test_generations_are_the_engines_greedy_text(lm_eval_run, engine):
    samples = lm_eval_run["samples"]["cpud_gen"]
    assert len(samples) == len(QUESTIONS)
    eos = engine.tokenizer.eos_token
    params = SamplingParams(max_tokens=MAX_GEN_TOKS, temperature=0, stop=["\n", eos])
    for sample in samples:
        context = sample["arguments"][0][0]
        ids = engine.tokenizer.encode(context, add_special_tokens=False)
        assert sample["resps"][0][0] == engine.generate([ids], params)[0].outputs[0].text
    assert "exact_match,none" in lm_eval_run["results"]["cpud_gen"]
