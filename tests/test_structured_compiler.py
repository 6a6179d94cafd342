"""Compiling constraints: specs to llguidance grammars, errors, the cache, metrics, and the
logit_bias field of SamplingParams."""

from __future__ import annotations

import json
import re
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from cpud import SamplingParams
from cpud.settings.errors import RequestError
from cpud.structured.compiler import GrammarCompiler
from cpud.structured.grammar import closed_objects, embedded_json
from cpud.structured.limits import GrammarLimits
from cpud.structured.matcher import ConstraintViolation, SequenceConstraint
from cpud.structured.metrics import structured_families
from cpud.structured.spec import StructuredSpec
from cpud.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def compiler(model_factory):
    return GrammarCompiler(Tokenizer(model_factory("llama")), limits=GrammarLimits(cache_mib=1))


def text_of(compiler: GrammarCompiler, spec: StructuredSpec, text: str) -> SequenceConstraint:
    """A constraint fed the greedy tokenization of `text`, token by token."""
    constraint = SequenceConstraint(compiler.matcher(spec))
    for token in compiler.ll_tokenizer().tokenize_str(text):
        constraint.advance(token)
    return constraint


@pytest.mark.parametrize(
    "spec, param, pattern",
    [
        (StructuredSpec("json", '{"type": "strin"}'), "response_format", "strin"),
        (StructuredSpec("json", "{not json", source="guided_json"), "guided_json", "not JSON"),
        (StructuredSpec("json", "[1, 2]"), "response_format", "must be an object"),
        (StructuredSpec("regex", "a(b", source="guided_regex"), "guided_regex", "unclosed"),
        (StructuredSpec("regex", "", source="guided_regex"), "guided_regex", "empty"),
        (StructuredSpec("choice", source="guided_choice"), "guided_choice", "at least one"),
        (StructuredSpec("grammar", "start: foo", source="guided_grammar"), "guided_grammar", "foo"),
        (StructuredSpec("json", '{"type": "integer", "minimum": 5, "maximum": 1}'), None, "."),
    ],
)
def test_bad_specs_are_request_errors_naming_their_field(compiler, spec, param, pattern):
    with pytest.raises(RequestError, match=pattern) as caught:
        compiler.check(spec)
    assert caught.value.param == spec.source
    assert param is None or str(caught.value).startswith(f"{param}: ")
    assert "\n" not in str(caught.value)


def test_json_whitespace_is_fixed_and_objects_are_closed(compiler):
    spec = StructuredSpec("json", json.dumps({"type": "object", "properties": {"a": {}}}))
    assert text_of(compiler, spec, '{"a": [1, 2]}').complete
    with pytest.raises(ConstraintViolation):
        text_of(compiler, spec, '{"a":1}')  # no free whitespace: ": " is the separator
    with pytest.raises(ConstraintViolation):
        text_of(compiler, spec, '{"a": 1, "b"')  # properties the schema names, no others
    loose = {"type": "object", "properties": {"a": {}}, "additionalProperties": True}
    assert text_of(compiler, StructuredSpec("json", json.dumps(loose)), '{"b": 1}').complete


def test_closed_objects_leaves_open_schemas_and_all_of_members_alone():
    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object", "properties": {"x": {}}}},
        "allOf": [{"properties": {"y": {}}}],
        "$defs": {"p": {"properties": {"z": {}}, "patternProperties": {"^a": {}}}},
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]  # a property map, not a schema
    assert "additionalProperties" not in closed["allOf"][0]
    assert "additionalProperties" not in closed["$defs"]["p"]
    assert "additionalProperties" not in schema  # a copy


def test_choice_regex_and_grammar_kinds(compiler):
    choice = StructuredSpec("choice", choices=("yes", 'say "no"', "a\\b"))
    for text in ("yes", 'say "no"', "a\\b"):
        assert text_of(compiler, choice, text).complete
    with pytest.raises(ConstraintViolation):
        text_of(compiler, choice, "maybe")
    regex = StructuredSpec("regex", r"[0-9]{3}")
    assert text_of(compiler, regex, "123").complete
    assert not text_of(compiler, regex, "12").complete
    lark = StructuredSpec("grammar", 'start: "x" NUM\nNUM: /[0-9]+/')
    constraint = text_of(compiler, lark, "x42")
    assert not constraint.complete  # more digits may follow: end of sequence is allowed too


def test_cache_hands_out_independent_matchers_and_stays_bounded(compiler):
    spec = StructuredSpec("regex", "ab|ac")
    first = SequenceConstraint(compiler.matcher(spec))
    second = SequenceConstraint(compiler.matcher(spec))
    first.advance(compiler.ll_tokenizer().tokenize_str("a")[0])
    assert first.allowed_mask() != second.allowed_mask()
    for index in range(10):
        compiler.check(StructuredSpec("regex", f"x{index}"))
    assert 0 < compiler._cache.bytes <= compiler.limits.cache_bytes


def test_typical_schema_compiles_fast(compiler):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
    }
    started = time.perf_counter()
    compiler.check(StructuredSpec("json", json.dumps(schema)))
    assert time.perf_counter() - started < 0.5  # about 1 ms unloaded; generous for a busy box


def test_metrics_count_requests_by_kind_and_compile_time(compiler):
    compiler.count_request("json")
    compiler.count_request("json")
    compiler.count_request("regex")
    compiler.check(StructuredSpec("regex", "metrics[0-9]"))

    class Stats(Collector):
        def collect(self):
            return structured_families(compiler.stats())

    registry = CollectorRegistry()
    registry.register(Stats())
    text = generate_latest(registry).decode()
    assert 'cpud_structured_requests_total{kind="json"} 2.0' in text
    assert 'cpud_structured_requests_total{kind="regex"} 1.0' in text
    count = re.search(r"^cpud_grammar_compile_seconds_count (\S+)$", text, re.M)
    assert count and float(count.group(1)) >= 1
    assert 'cpud_grammar_compile_seconds_bucket{le="+Inf"}' in text


@pytest.mark.parametrize(
    "bias, expected",
    [
        ({"5": 1, 3: -100}, ((3, -100.0), (5, 1.0))),
        ([(7, 100.0)], ((7, 100.0),)),
        ({}, ()),
        (None, ()),
    ],
)
def test_logit_bias_is_normalised(bias, expected):
    assert SamplingParams(logit_bias=bias).logit_bias == expected


@pytest.mark.parametrize(
    "bias, pattern",
    [
        ({"1": 101}, "between -100 and 100"),
        ({"1": float("nan")}, "finite"),
        ({"x": 1}, "token ids"),
        ({"-1": 1}, "token ids"),
        ({-1: 1}, "token ids"),
        ({"1": "high"}, "must be a number"),
        ({i: 1 for i in range(301)}, "at most 300"),
        ([(1, 1), (1, 2)], "twice"),
        ("abc", "map token ids"),
        ([1, 2], "map token ids"),
    ],
)
def test_bad_logit_bias_names_the_field(bias, pattern):
    with pytest.raises(RequestError, match=pattern) as caught:
        SamplingParams(logit_bias=bias)
    assert caught.value.param == "logit_bias"


def test_json_embedded_in_a_grammar_is_generated_like_kind_json(compiler):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    lark = f'start: "<call>" body "</call>"\nbody: {embedded_json(schema)}\n'
    spec = StructuredSpec("grammar", lark, source="tools")
    assert text_of(compiler, spec, '<call>{"city": "Oslo"}</call>').complete
    for wrong in ('<call>{"city":"Oslo"}', '<call>{"city": "Oslo", "x"'):
        with pytest.raises(ConstraintViolation):
            text_of(compiler, spec, wrong)
