"""Hostile output constraints are bounded: refused at validation (RequestError, a 400) when
their input makes them unusable, compiled on low-priority threads within a wait, cancelled
with their request, kept in a cache bounded in bytes; a tokenizer llguidance panics on is
converted once."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading

import llguidance
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from cpud import LLM, SamplingParams
from cpud.frontend.constraints import while_connected
from cpud.frontend.errors import APIError
from cpud.settings.errors import ConfigError, RequestError
from cpud.structured import compiler as compiler_module
from cpud.structured.compiler import GrammarBusyError, GrammarCompiler, first_allowed
from cpud.structured.limits import GrammarLimits
from cpud.structured.matcher import SequenceConstraint
from cpud.structured.metrics import structured_families
from cpud.structured.pool import NICENESS, compile_scope
from cpud.structured.spec import StructuredSpec
from cpud.text.tokenizer import Tokenizer


def exploding_regex(n: int) -> StructuredSpec:
    return StructuredSpec("regex", "a{1000}{1000}{" + str(n) + "}", source="guided_regex")


def properties_schema(count: int, required: bool, tag: str = "p") -> str:
    props = {f"{tag}{i}": {"type": "string"} for i in range(count)}
    schema: dict = {"type": "object", "properties": props}
    if required:
        schema["required"] = list(props)
    return json.dumps(schema)


@pytest.fixture(scope="module")
def tokenizer(model_factory):
    return Tokenizer(model_factory("llama"))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer)


def test_a_regex_that_explodes_the_lexer_is_refused_at_validation(compiler):
    with pytest.raises(RequestError, match="first token.*too many expressions") as caught:
        compiler.check(exploding_regex(7))
    assert caught.value.param == "guided_regex"


def test_a_schema_past_the_lexer_fuel_is_refused(compiler):
    spec = StructuredSpec("json", properties_schema(10_000, required=False), source="guided_json")
    with pytest.raises(RequestError, match="too big") as caught:
        compiler.check(spec)
    assert caught.value.param == "guided_json"
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#"},
        {"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"},
    ],
)
def test_a_schema_that_allows_no_output_is_refused_at_validation(compiler, schema):
    with pytest.raises(RequestError, match="allows no output") as caught:
        compiler.check(StructuredSpec("json", json.dumps(schema)))
    assert caught.value.param == "response_format"


def test_the_engine_refuses_hostile_grammars_before_admitting(model_factory):
    llm = LLM(model_factory("llama"), dtype="float32")
    params = SamplingParams(max_tokens=4, structured=exploding_regex(3))
    with pytest.raises(RequestError, match="guided_regex"):
        llm.engine.validate([1, 2, 3], params)
    good = SamplingParams(max_tokens=4, structured=StructuredSpec("regex", "[0-9]{3}"))
    admission = llm.engine.validate([1, 2, 3], good)
    constraint = admission.grammar.constraint()
    # The first mask was worked out by validation: the engine thread takes it as it is.
    assert constraint.allowed_mask() is admission.grammar.first_mask
    assert any(admission.grammar.first_mask)
    outputs = llm.generate([[1, 2, 3]], good)
    assert outputs[0].outputs[0].text.isdigit()


def test_compile_threads_run_at_lowered_priority(compiler):
    niceness = compiler._pool.submit(
        lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    ).result(30)
    assert niceness >= NICENESS


def blocked(compiler: GrammarCompiler, threads: int) -> threading.Event:
    """Occupies every compile thread until the returned event is set."""
    release = threading.Event()
    for _ in range(threads):
        compiler._pool.submit(lambda: release.wait(60))
    return release


def test_compiles_of_an_ended_request_never_run(tokenizer):
    compiler = GrammarCompiler(tokenizer, limits=GrammarLimits(compile_threads=1))
    release = blocked(compiler, 1)
    spec = StructuredSpec("regex", "ended[0-9]+", source="guided_regex")
    caught: list[BaseException] = []

    def request(scope_ready: threading.Event, scope_box: list) -> None:
        with compile_scope() as scope:
            scope_box.append(scope)
            scope_ready.set()
            try:
                compiler.check(spec)
            except BaseException as exc:
                caught.append(exc)

    ready, box = threading.Event(), []
    thread = threading.Thread(target=request, args=(ready, box))
    thread.start()
    ready.wait(10)
    box[0].close()  # the client left while its compile was queued
    thread.join(10)
    release.set()
    assert len(caught) == 1 and "ended before" in str(caught[0])
    compiler._pool.submit(lambda: None).result(30)  # the queue has drained
    stats = compiler.stats()
    assert sum(stats.compile_counts) == 0 and stats.rejected["cancelled"] == 1
    assert compiler.cache_entries == 0


def test_a_request_waits_for_its_grammar_at_most_the_timeout(tokenizer, monkeypatch):
    compiler = GrammarCompiler(
        tokenizer, limits=GrammarLimits(compile_threads=1, compile_timeout=0.3)
    )
    release = blocked(compiler, 1)
    with pytest.raises(GrammarBusyError, match="retry"):
        compiler.check(StructuredSpec("regex", "busy[0-9]"))
    release.set()
    slow = threading.Event()
    build = compiler._build
    monkeypatch.setattr(compiler, "_build", lambda *a: (slow.wait(30), build(*a))[1])
    with pytest.raises(RequestError, match="did not compile within 0.3 s") as caught:
        compiler.check(StructuredSpec("regex", "slow[0-9]", source="guided_regex"))
    assert caught.value.param == "guided_regex"
    slow.set()
    assert compiler.stats().rejected == {"busy": 1, "timeout": 1}


def test_the_cache_is_bounded_in_bytes_and_keeps_no_big_grammar(tokenizer):
    compiler = GrammarCompiler(tokenizer, limits=GrammarLimits(cache_mib=1))
    # 80 grammars of ~110 bytes are estimated at 192 bytes a grammar byte at least: ~1.6 MiB
    for index in range(80):
        compiler.check(StructuredSpec("regex", f"cached{index}[a-z]{{2,9}}"))
    assert 0 < compiler.stats().cache_bytes <= 1 << 20
    assert compiler.cache_entries < 80  # least recently used ones went
    kept = compiler.cache_entries
    big = StructuredSpec("json", properties_schema(500, required=True))
    compiler.check(big)  # ~20 kB of grammar: more than an eighth of the budget
    assert compiler.cache_entries == kept and compiler.stats().cache_bytes <= 1 << 20


def test_rejections_and_cache_bytes_are_metrics(compiler):
    with pytest.raises(RequestError):
        compiler.check(exploding_regex(11))

    class Stats(Collector):
        def collect(self):
            return structured_families(compiler.stats())

    registry = CollectorRegistry()
    registry.register(Stats())
    text = generate_latest(registry).decode()
    assert 'cpud_grammar_rejected_total{reason="invalid"}' in text
    assert 'cpud_grammar_rejected_total{reason="invalid"} 0.0' not in text
    assert "cpud_grammar_cache_bytes " in text


def test_a_tokenizer_llguidance_panics_on_is_converted_once(model_factory, tmp_path, monkeypatch):
    """A vocabulary entry of a few kB makes llguidance's tokenizer conversion panic (a
    BaseException): each constrained request gets the stored answer, no new attempt."""
    model = model_factory("llama")
    for name in os.listdir(model):
        (tmp_path / name).symlink_to(model / name)
    (tmp_path / "tokenizer.json").unlink()
    data = json.loads((model / "tokenizer.json").read_text())
    used = [*data["model"]["vocab"].values(), *(t["id"] for t in data["added_tokens"])]
    data["added_tokens"].append(
        {
            "id": max(used) + 1,
            "content": "x" * 4200,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": False,
        }
    )
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    calls = []
    build = compiler_module.build_ll_tokenizer
    monkeypatch.setattr(
        compiler_module, "build_ll_tokenizer", lambda *a: (calls.append(1), build(*a))[1]
    )
    compiler = GrammarCompiler(Tokenizer(tmp_path))
    for _ in range(3):
        with pytest.raises(RequestError, match="not available with this model's tokenizer"):
            compiler.check(StructuredSpec("regex", "[0-9]+", source="guided_regex"))
    assert len(calls) == 1


def test_a_grammar_past_the_limits_while_generating_is_the_request_s_error(tokenizer):
    """Past validation (which tries one token), a grammar that then exceeds llguidance's
    limits ends its request with a RequestError (the client's 400 or error event)."""
    ll_tokenizer = GrammarCompiler(tokenizer).ll_tokenizer()
    grammar = llguidance.LLMatcher.grammar_from_regex("a{1000}{1000}{7}")
    constraint = SequenceConstraint(llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0))
    token = first_allowed(constraint.allowed_mask(), ())
    with pytest.raises(RequestError, match="grammar limits after 0 tokens.*too many"):
        constraint.advance(token)


@pytest.mark.parametrize(
    "settings, words",
    [
        ({"compile_timeout": 0}, "--grammar-compile-timeout"),
        ({"compile_timeout": float("nan")}, "--grammar-compile-timeout"),
        ({"compile_threads": 0}, "--grammar-compile-threads"),
        ({"cache_mib": -1}, "--grammar-cache-mib"),
        ({"lexer_fuel": 0}, "lexer_fuel"),
    ],
)
def test_bad_grammar_limits_are_config_errors(settings, words):
    with pytest.raises(ConfigError, match=words):
        GrammarLimits(**settings)


def test_busy_compile_threads_are_a_429_and_a_finished_validation_passes_through():
    async def busy():
        raise GrammarBusyError("guided_regex: the compiler was busy; retry shortly")

    async def fine():
        return "admitted"

    with pytest.raises(APIError) as caught:
        asyncio.run(while_connected(None, busy()))
    assert caught.value.status == 429 and caught.value.code == "grammar_busy"
    assert asyncio.run(while_connected(None, fine())) == "admitted"


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--grammar-compile-timeout", "0"),
        ("--grammar-compile-threads", "0"),
        ("--grammar-cache-mib", "-1"),
    ],
)
def test_bad_grammar_flags_stop_the_daemon_with_exit_2(flag, value):
    result = subprocess.run(
        [sys.executable, "-m", "cpud.cli", "serve", "--port", "1", flag, value],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result
    assert result.stderr.startswith("cpud: error: ") and flag in result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
