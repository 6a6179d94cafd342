"""pyproject.toml names every package of the source tree (a regular install ships exactly
those) and every native source the build compiles is package data."""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # the [test] extra installs tomli there
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent


def test_every_package_folder_is_listed():
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {path: name for name, path in tool["package-dir"].items()}
    found = set()
    for folder, name in roots.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            if "__pycache__" not in rel.parts:
                found.add(".".join([name, *rel.parts]))
    assert found == set(tool["packages"])


def test_native_sources_are_package_data():
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = tool["package-data"]["cpud.native"]
    native = REPO / "native"
    shipped = {p for pattern in patterns for p in native.glob(pattern)}
    sources = {p for p in native.rglob("*") if p.suffix in (".c", ".h")}
    assert sources and sources == shipped
