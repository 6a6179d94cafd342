"""README's configuration reference names every `cpud serve` flag and environment variable."""

from __future__ import annotations

from pathlib import Path

from cpud.cli import serve_env_vars

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_every_serve_flag_and_env_var_is_in_the_readme():
    reference = README[README.index("### Configuration reference") :]
    reference = reference[: reference.index("### Running under systemd")]
    env_vars = serve_env_vars()
    missing = sorted(name for name in env_vars if f"`{name}`" not in reference)
    missing += sorted({flag for flag in env_vars.values() if f"`{flag}" not in reference})
    assert not missing, f"README's configuration reference lacks {missing}"
