"""Every output generated under a JSON schema parses and validates against it."""

from __future__ import annotations

import json

import jsonschema
import pytest
from structured_schemas import SCHEMAS

from cpud import LLM, SamplingParams
from cpud.structured.spec import StructuredSpec

SEEDS = (0, 1, 2)


def closing_bias(llm: LLM) -> dict[int, float]:
    """logit_bias favouring tokens that end a JSON value: a random model left alone writes
    strings and numbers without end, which no grammar can prevent. Closing quotes and brackets
    win over commas, so objects that may take more properties do end."""
    bias = {}
    for token in range(llm.tokenizer.vocab_size):
        text = llm.tokenizer.decode([token], skip_special_tokens=False)
        if text and set(text) <= set('"]}'):
            bias[token] = 8.0
        elif text and set(text) <= set('"]},'):
            bias[token] = 4.0
    return bias


def check(outputs, names: list[str]) -> None:
    failures = []
    for output, name in zip(outputs, names):
        choice = output.outputs[0]
        try:
            assert choice.finish_reason == "stop", f"finish_reason {choice.finish_reason}"
            jsonschema.validate(json.loads(choice.text), SCHEMAS[name])
        except Exception as exc:  # collected: the message lists every failing schema
            failures.append(f"{name}: {type(exc).__name__}: {str(exc)[:200]} in {choice.text!r}")
    assert not failures, "\n".join(failures)


@pytest.fixture(scope="module")
def llama(model_factory):
    return LLM(model=model_factory("llama"), dtype="float32")


def test_schema_table_on_random_weights(llama):
    """Each schema at temperature 0 and at temperature 1 with three seeds, all in one batch
    (constrained sequences of different grammars side by side)."""
    assert len(SCHEMAS) >= 20
    bias = tuple(closing_bias(llama).items())
    assert bias, "the fixture tokenizer has no closing tokens"
    prompts, params, names = [], [], []
    for name, schema in SCHEMAS.items():
        spec = StructuredSpec("json", json.dumps(schema))
        settings = [(0.0, None)] + [(1.0, seed) for seed in SEEDS]
        for temperature, seed in settings:
            prompts.append(f"Write {name} as JSON:")
            params.append(
                SamplingParams(
                    temperature=temperature,
                    seed=seed,
                    max_tokens=400,
                    structured=spec,
                    logit_bias=bias,
                )
            )
            names.append(name)
    check(llama.generate(prompts, params), names)


def test_schemas_on_the_default_model():
    """The real SmolLM2-135M-Instruct (its GGUF tokenizer), greedy and sampled, with nothing
    but the schema and a prompt that states the facts."""
    llm = LLM()
    cases = [
        ("optional_fields", "Ana is 31 and her email is ana@example.com. Reply in JSON.", 1.0),
        ("object_array", "Two products: id 1 is an apple, id 2 is a pear. Reply in JSON.", 1.0),
        ("number_bounds", "Paris lies at latitude 48.85, longitude 2.35. Reply in JSON.", 0.0),
        ("string_enum", "What color is a clear sky: red, green or blue?", 1.0),
        ("pydantic_style", "Invoice A-17 totals 120.5 and was sent. Reply in JSON.", 0.0),
    ]
    prompts, params, names = [], [], []
    for name, question, temperature in cases:
        conversation = [{"role": "user", "content": question}]
        prompt = llm.tokenizer.apply_chat_template(conversation)
        ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
        spec = StructuredSpec("json", json.dumps(SCHEMAS[name]))
        for temp in {0.0, temperature}:
            prompts.append(ids)
            params.append(SamplingParams(temperature=temp, seed=7, max_tokens=100, structured=spec))
            names.append(name)
    outputs = llm.generate(prompts, params)
    check(outputs, names)
    greedy = {n: o for n, o, p in zip(names, outputs, params) if p.temperature == 0}
    assert json.loads(greedy["optional_fields"].outputs[0].text)["age"] == 31  # the model's
