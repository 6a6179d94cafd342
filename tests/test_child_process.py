"""cpud's children run the installed package even where the working directory holds a folder
named like it, and keep what `python -m` gives a module (sys.argv, __main__, PYTHONPATH)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cpud import LLM, SamplingParams, native
from cpud.process.child_process import module_command


@pytest.fixture
def decoy(tmp_path) -> Path:
    """A folder holding a `cpud` package that is not cpud, and a `runpy` module that fails."""
    package = tmp_path / "cpud"
    (package / "ranks").mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('the decoy cpud was imported')\n")
    (package / "ranks" / "__init__.py").write_text("")
    (tmp_path / "runpy.py").write_text("raise ImportError('the decoy runpy was imported')\n")
    return tmp_path


def run(argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, cwd=cwd, capture_output=True, text=True, timeout=60, env={**os.environ, **env}
    )


def test_python_dash_m_there_imports_the_decoy(decoy):
    result = run([sys.executable, "-m", "cpud.cli", "--help"], decoy)
    assert result.returncode != 0 and "decoy cpud" in result.stderr


def test_a_child_started_there_runs_the_installed_package(decoy):
    result = run(module_command("cpud.cli", "--help"), decoy)
    assert result.returncode == 0, result.stderr
    assert "serve" in result.stdout


def test_the_module_sees_what_python_dash_m_gives_it(decoy, tmp_path_factory):
    extra = tmp_path_factory.mktemp("pythonpath")
    (extra / "probe.py").write_text(
        "import sys\n"
        "import user_module\n"
        "print(__name__, sys.argv[0] == __file__, sys.argv[1:], user_module.VALUE)\n"
        "print('' in sys.path, sys.path[0] == str(__import__('os').getcwd()))\n"
    )
    (extra / "user_module.py").write_text("VALUE = 42\n")
    result = run(module_command("probe", "a b", "--flag"), decoy, PYTHONPATH=str(extra))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["__main__ True ['a b', '--flag'] 42", "False False"]


@pytest.mark.skipif(not native.available(), reason="native library not built")
def test_rank_processes_start_from_a_folder_holding_a_decoy(decoy, model_factory, monkeypatch):
    model = model_factory("qwen3")
    monkeypatch.chdir(decoy)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with LLM(model, dtype="float32", tp=2, collective="shm", weight_cache="off") as llm:
        (out,) = llm.generate([[5, 6, 7]], params)
    assert len(out.outputs[0].token_ids) == 4
