"""README's configuration reference is the settings table's rendering, and names every
`cpud serve` flag and environment variable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cpud.cli import serve_env_vars
from cpud.settings.reference import BEGIN, END, readme_section, render_markdown, replace_section

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_the_readme_reference_is_the_rendering_of_the_settings_table():
    assert readme_section(README) == render_markdown(), (
        "README's configuration reference differs from the settings table: run "
        "`python3 -m cpud.settings --readme README.md`"
    )


def test_the_reference_sits_in_its_section():
    section = README[README.index("### Configuration reference") :]
    section = section[: section.index("\n### ", 1)]
    assert BEGIN in section and END in section


def test_every_serve_flag_and_env_var_is_in_the_readme():
    reference = readme_section(README)
    env_vars = serve_env_vars()
    missing = sorted(name for name in env_vars if f"`{name}`" not in reference)
    missing += sorted({flag for flag in env_vars.values() if f"`{flag}" not in reference})
    assert not missing, f"README's configuration reference lacks {missing}"


def test_the_command_prints_the_rendering_and_rewrites_only_the_section(tmp_path):
    printed = subprocess.run(
        [sys.executable, "-m", "cpud.settings", "--markdown"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert printed.stdout == render_markdown()
    readme = tmp_path / "README.md"
    readme.write_text(f"# t\n\n{BEGIN}\nold text\n{END}\n\nafter\n")
    subprocess.run([sys.executable, "-m", "cpud.settings", "--readme", str(readme)], check=True)
    assert readme.read_text() == f"# t\n\n{BEGIN}\n{render_markdown()}{END}\n\nafter\n"
    with pytest.raises(ValueError, match="no reference section"):
        replace_section("# no markers\n")
