"""deploy/cpud.env documents every variable `cpud serve` reads, at its default, and no other."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
from deploy_helpers import (
    ACTIVE,
    ENV_FILE,
    REPO,
    SETTING,
    env_settings,
    serve_defaults,
    serve_parser,
)

# Variables the daemon reads that are not `cpud serve` flags, with the source that reads each.
EXTRA_VARIABLES = {
    "CPUD_ISA": "native/_loader.py",
    "CPUD_CACHE_DIR": "daemon/fixtures/cache.py",
    "CPU_VISIBLE_MEMORY_NODES": "daemon/placement/binding.py",
}
# Read by torch's OpenMP runtime in the ranks (checked below); cpud itself passes it through.
OPENMP_VARIABLES = {"OMP_NUM_THREADS"}


@pytest.fixture(scope="module")
def text() -> str:
    return ENV_FILE.read_text()


@pytest.fixture(scope="module")
def settings(text) -> dict[str, str]:
    return env_settings(text)


@pytest.fixture(scope="module")
def env_vars() -> dict[str, str]:
    try:
        from cpud.cli import serve_env_vars
    except ImportError:
        pytest.fail("cpud.cli.serve_env_vars() is missing: it maps env var names to serve flags")
    return serve_env_vars()


def test_everything_is_commented_out(text):
    for number, line in enumerate(text.splitlines(), 1):
        assert not line or line.startswith("#"), f"line {number} is active: {line!r}"
        assert not ACTIVE.match(line), f"line {number} sets a variable: {line!r}"


def test_every_setting_is_documented(text):
    lines = text.splitlines()
    for index, line in enumerate(lines):
        if not SETTING.match(line):
            continue
        above = index - 1
        while above >= 0 and SETTING.match(lines[above]):
            above -= 1
        assert above >= 0 and lines[above].startswith("# "), f"{line} has no description"


def test_every_serve_variable_is_in_the_file(settings, env_vars):
    assert env_vars, "serve_env_vars() is empty"
    assert "CPUD_PORT" in env_vars and "VLLM_CPU_KVCACHE_SPACE" in env_vars
    missing = sorted(set(env_vars) - set(settings))
    assert not missing, f"not in deploy/cpud.env: {missing}"


def test_every_variable_in_the_file_is_read(settings, env_vars):
    known = set(env_vars) | set(EXTRA_VARIABLES) | OPENMP_VARIABLES
    unknown = sorted(set(settings) - known)
    assert not unknown, f"deploy/cpud.env sets variables cpud never reads: {unknown}"


@pytest.mark.parametrize("name", sorted(EXTRA_VARIABLES))
def test_extra_variables_are_read_by_their_module(name):
    source = (REPO / EXTRA_VARIABLES[name]).read_text()
    assert f'"{name}"' in source


def test_omp_num_threads_reaches_torch():
    code = "import os, torch; print(torch.get_num_threads(), len(os.sched_getaffinity(0)))"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    threads, cpus = out.stdout.split()
    # torch caps the count at the CPUs it may use, so only 1 is observable everywhere.
    assert threads == "1", f"OMP_NUM_THREADS=1 gave {threads} threads on {cpus} CPUs"


def _parse(action: argparse.Action, raw: str) -> object:
    if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
        assert raw in ("true", "false"), f"{action.dest}: booleans are true or false, not {raw!r}"
        return raw == "true"
    return action.type(raw) if action.type else raw


def test_values_are_the_daemon_defaults(settings, env_vars, monkeypatch):
    defaults = serve_defaults(monkeypatch)
    actions = serve_parser()._option_string_actions
    checked = 0
    for name, flag in env_vars.items():
        action = actions[flag]
        default = getattr(defaults, action.dest)
        raw = settings[name]
        if default is None:
            continue  # the effective default is decided later; the comment says which
        assert raw, f"#{name}= is empty but {flag} defaults to {default!r}"
        assert _parse(action, raw) == default, f"#{name}={raw} but {flag} defaults to {default!r}"
        checked += 1
    assert checked >= 10


def test_aliases_agree(settings, env_vars):
    by_flag: dict[str, set[str]] = {}
    for name, flag in env_vars.items():
        by_flag.setdefault(flag, set()).add(settings[name])
    assert {flag: v for flag, v in by_flag.items() if len(v) > 1} == {}


def test_kv_cache_space_default():
    from cpud.settings.config import DEFAULT_KV_CACHE_SPACE_GIB

    settings = env_settings(ENV_FILE.read_text())
    assert float(settings["CPUD_KV_CACHE_SPACE"]) == DEFAULT_KV_CACHE_SPACE_GIB
    assert float(settings["VLLM_CPU_KVCACHE_SPACE"]) == DEFAULT_KV_CACHE_SPACE_GIB
