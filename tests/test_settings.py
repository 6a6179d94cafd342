"""The settings table is the one declaration of every engine and serve setting: the flags of
`cpud serve`, `cpud doctor` and `cpud generate`, their environment variables, the dataclass
defaults, the choice lists and the offline LLM's keywords all come from it."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import subprocess
import sys

import pytest

from cpud import settings
from cpud.cli import apply_env_defaults, build_parser, main
from cpud.settings import DOCTOR, ENGINE, GENERATE, SERVE, SETTINGS, Setting, in_group
from cpud.settings.config import EngineArgs, ServeArgs
from cpud.settings.errors import ConfigError
from cpud.structured.limits import GrammarLimits

# Flags of the commands that are not settings: the doctor's report format and its testing
# aids, and the sampling of `cpud generate`'s prompts.
NOT_SETTINGS = {
    DOCTOR: {"--json", "--sysfs-root", "--proc-root", "--cgroup-root"},
    GENERATE: {"--max-tokens", "--temperature", "--top-p", "--top-k", "--sample-seed"}
    | {"--ignore-eos", "--json"},
    SERVE: set(),
}


def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[name]


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings} - {"-h", "--help"}


def table_flags(command: str) -> set[str]:
    forms = set()
    for item in in_group(command):
        forms.update(item.flags)
        if item.negatable:
            forms.add("--no-" + item.long_flag.removeprefix("--"))
    return forms


def test_each_setting_flag_and_variable_is_declared_once():
    for what in ("name", "dest", "long_flag"):
        values = [getattr(s, what) for s in SETTINGS if s.flags or what == "name"]
        assert len(values) == len(set(values)), f"a {what} appears twice"
    flags = [f for s in SETTINGS for f in s.flags]
    variables = [v for s in SETTINGS for v in s.env_names]
    assert len(flags) == len(set(flags)) and len(variables) == len(set(variables))


@pytest.mark.parametrize("command", [SERVE, DOCTOR, GENERATE])
def test_each_command_has_exactly_the_flags_of_its_settings(command):
    parser = subparser(build_parser(), command)
    assert option_strings(parser) == table_flags(command) | NOT_SETTINGS[command]


def test_a_setting_added_to_the_table_shows_in_serve_and_doctor(monkeypatch, capsys):
    added = Setting(
        "probe_depth",
        int,
        3,
        "how deep the probe goes",
        frozenset({ENGINE, SERVE, DOCTOR}),
        flags=("--probe-depth",),
        env_aliases=("VLLM_PROBE_DEPTH",),
        choices=None,
    )
    monkeypatch.setattr(settings, "SETTINGS", (*SETTINGS, added))
    for command in ("serve", "doctor"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        shown = " ".join(capsys.readouterr().out.split())
        assert "--probe-depth PROBE_DEPTH how deep the probe goes" in shown, command
        assert "[env CPUD_PROBE_DEPTH or VLLM_PROBE_DEPTH; default 3]" in shown, command
    parser = build_parser()
    apply_env_defaults(parser, {"VLLM_PROBE_DEPTH": "5"})
    assert parser.parse_args(["doctor"]).probe_depth == 5
    assert parser.parse_args(["serve", "--probe-depth", "7"]).probe_depth == 7
    assert "probe_depth" not in vars(parser.parse_args(["generate"]))


def test_the_llm_takes_exactly_the_engine_settings_at_their_defaults():
    from cpud import LLM
    from cpud.llm import engine_args

    params = inspect.signature(LLM).parameters
    engine = {s.name: s.default for s in in_group(ENGINE)}
    assert {name: p.default for name, p in params.items() if name in engine} == engine
    assert set(params) - set(engine) == {"tensor_parallel_size"}
    assert next(iter(params)) == "model"
    assert all(p.kind is p.KEYWORD_ONLY for name, p in params.items() if name != "model")
    assert engine_args("m", {}) == EngineArgs(model="m")
    assert engine_args(None, {"tensor_parallel_size": 2}).tp == 2
    assert engine_args(None, {"tp": 2, "tensor_parallel_size": None}).tp == 2
    with pytest.raises(TypeError, match="'kv_cache_space'"):
        engine_args(None, {"kv_cache_space": 2})
    with pytest.raises(TypeError, match="unexpected keyword argument 'host'"):
        LLM(host="0.0.0.0")
    with pytest.raises(TypeError, match="tp and its alias tensor_parallel_size"):
        engine_args(None, {"tp": 1, "tensor_parallel_size": 2})


def test_engine_and_serve_args_default_as_the_table_says():
    engine = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    assert engine == settings.defaults(ENGINE)
    serve = {s.name: s.default for s in in_group(SERVE)}
    fields = {f.name: f for f in dataclasses.fields(ServeArgs)}
    shared = set(fields) & set(serve)
    assert len(shared) >= 12
    for name in shared - {"served_model_names"}:  # None there: the --model value, () here
        assert fields[name].default == serve[name], name
    grammar = ServeArgs().grammar
    assert grammar == GrammarLimits()  # its own defaults (cpud.structured.limits) agree
    assert (grammar.compile_timeout, grammar.compile_threads, grammar.cache_mib) == (
        serve["grammar_compile_timeout"],
        serve["grammar_compile_threads"],
        serve["grammar_cache_mib"],
    )


def test_the_flags_parse_to_the_table_defaults():
    parser = build_parser()
    for command in (SERVE, DOCTOR, GENERATE):
        parsed = vars(parser.parse_args([command]))
        assert {s.dest: parsed[s.dest] for s in in_group(command)} == {
            s.dest: s.default for s in in_group(command)
        }


def test_other_modules_keep_the_tables_choices_and_names():
    """Modules outside the CLI that name a choice list or a variable agree with the table."""
    from cpud.frontend.tool_call_scan import MARKERS
    from cpud.frontend.tool_calls import PARSERS, detect_parser
    from cpud.frontend.tool_grammar import ARGUMENTS_KEY
    from cpud.model.quant_check import QUANTIZATION_CHOICES
    from cpud.placement.binding import BIND_ENV, RESERVED_ENV
    from cpud.settings.config import COLLECTIVES, KERNEL_KINDS

    assert KERNEL_KINDS == settings.choices("kernels")
    assert COLLECTIVES == settings.choices("collective")
    assert tuple(QUANTIZATION_CHOICES) == settings.choices("quantization")
    assert PARSERS is settings.choices("tool_call_parser")
    # Each parser the table offers is one the scanner and the tool grammar know, and only those.
    assert set(MARKERS) == set(ARGUMENTS_KEY) == set(PARSERS)
    templates = (None, "[TOOL_CALLS]", "<tool_call>", "<|python_tag|>")
    assert {detect_parser(t) for t in templates} == set(PARSERS)
    assert (BIND_ENV,) == settings.setting("bind").env_aliases
    assert (RESERVED_ENV,) == settings.setting("reserved_cpus").env_aliases


# Run before anything else imports the modules below: the table answers with other values, and
# each module, imported afterwards, must take them (no copy of its own can follow the change).
CHANGED_TABLE = """
import dataclasses, inspect, json, sys

import cpud.settings as table

late = ("cpud.frontend.tool_calls", "cpud.placement.binding", "cpud.placement.memory_plan",
        "cpud.structured.limits", "cpud.settings.cors_policy")
assert not set(late) & set(sys.modules), set(late) & set(sys.modules)
original = table.setting
changes = {
    "tool_call_parser": {"choices": ("hermes", "llama3_json", "mistral", "pythonic")},
    "bind": {"env_aliases": ("OTHER_BIND",)},
    "reserved_cpus": {"env_aliases": ("OTHER_RESERVED",)},
    "grammar_compile_timeout": {"default": 7.5},
    "grammar_compile_threads": {"default": 3},
    "grammar_cache_mib": {"default": 64},
    "block_size": {"default": 32},
    "max_num_seqs": {"default": 8},
}
table.setting = lambda name: dataclasses.replace(original(name), **changes.get(name, {}))
table.DEFAULT_MAX_NUM_BATCHED_TOKENS = 4096
table.CORS_ALLOW_ANY = ("GET",)

from cpud.settings.cors_policy import CorsPolicy
from cpud.frontend.tool_calls import PARSERS
from cpud.placement.binding import BIND_ENV, RESERVED_ENV, binding_spec
from cpud.placement.memory_plan import plan_memory
from cpud.structured.limits import GrammarLimits

plan = inspect.signature(plan_memory).parameters
limits = GrammarLimits()
spec = binding_spec(env={"OTHER_BIND": "nobind", "OTHER_RESERVED": "2"})
print(json.dumps({
    "parsers": PARSERS,
    "env": [BIND_ENV, RESERVED_ENV, spec.mode, spec.reserved, spec.bind_source],
    "grammar": [limits.compile_timeout, limits.compile_threads, limits.cache_mib],
    "plan": [plan[k].default for k in ("block_size", "max_num_seqs", "max_num_batched_tokens")],
    "cors": [CorsPolicy().methods, CorsPolicy().headers],
}))
"""


def test_modules_take_their_defaults_choices_and_names_from_the_table():
    out = subprocess.run(
        [sys.executable, "-c", CHANGED_TABLE], capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == {
        "parsers": ["hermes", "llama3_json", "mistral", "pythonic"],
        "env": ["OTHER_BIND", "OTHER_RESERVED", "nobind", 2, "OTHER_BIND"],
        "grammar": [7.5, 3, 64],
        "plan": [32, 8, 4096],
        "cors": [["GET"], ["GET"]],
    }


def test_the_modules_defaults_are_the_tables():
    from cpud.placement.memory_plan import plan_memory
    from cpud.settings.cors_policy import CorsPolicy

    plan = inspect.signature(plan_memory).parameters
    assert plan["max_num_batched_tokens"].default == settings.DEFAULT_MAX_NUM_BATCHED_TOKENS
    for name in ("block_size", "max_num_seqs"):
        assert plan[name].default == settings.setting(name).default, name
    assert CorsPolicy().methods is CorsPolicy().headers is settings.CORS_ALLOW_ANY
    assert CorsPolicy().enabled is False


def test_doctor_refuses_non_positive_values_while_parsing_and_serve_leaves_them_to_the_engine():
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["doctor", "--max-num-seqs", "0"])
    assert parser.parse_args(["serve", "--max-num-seqs", "0"]).max_num_seqs == 0
    with pytest.raises(ConfigError, match=r"CPUD_TP='0' \(sets --tp\): must be positive"):
        apply_env_defaults(build_parser(), {"CPUD_TP": "0"})


def test_a_setting_that_contradicts_itself_is_refused():
    with pytest.raises(ValueError, match="default 'x' is not one of"):
        Setting("k", str, "x", "h", frozenset({SERVE}), flags=("--k",), choices=("a",))
    with pytest.raises(ValueError, match="a command uses it but it has no flag"):
        Setting("k", str, None, "h", frozenset({SERVE}))
    with pytest.raises(ValueError, match="groups"):
        Setting("k", str, None, "h", frozenset({"bench"}), flags=("--k",))


def test_settings_import_neither_torch_nor_the_engine():
    code = (
        "import sys, cpud.settings, cpud.settings.flags, cpud.settings.reference\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or "
        "m.startswith(('cpud.settings.config', 'cpud.model', 'cpud.engine'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
