"""Shared pieces of the deployment asset tests: paths, external tools, unit and env file parsing,
and the metric names the frontend exports."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
UNIT = DEPLOY / "cpud.service"
ENV_FILE = DEPLOY / "cpud.env"
PROMETHEUS = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "cpud-dashboard.json"

REQUIRE_ENV = "CPUD_REQUIRE_DEPLOY_TOOLS"
INSTALL_HINT = {
    "systemd-analyze": "apt-get install systemd",
    "promtool": "apt-get install prometheus",
}


def require_tool(name: str) -> str:
    """Path of an external checker; skips without it unless CPUD_REQUIRE_DEPLOY_TOOLS is set."""
    path = shutil.which(name)
    if path:
        return path
    message = f"{name} is not installed ({INSTALL_HINT.get(name, 'install it')})"
    if os.environ.get(REQUIRE_ENV):
        pytest.fail(f"{message} and {REQUIRE_ENV} is set")
    pytest.skip(message)


def run_tool(*argv: str | os.PathLike, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=120
    )


# --- systemd units -----------------------------------------------------------------------------


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """{section: {key: [values in order]}}; repeated keys accumulate as systemd does."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], defaultdict(list))
            continue
        assert current is not None, f"setting outside a section: {line!r}"
        key, _, value = line.partition("=")
        current[key.strip()].append(value.strip())
    return sections


TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0, "min": 60.0, "m": 60.0, "h": 3600.0}


def timespan_seconds(text: str) -> float:
    """A systemd time span such as "60s", "1min 30s" or "90" (seconds)."""
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text)
    whole = "".join(n + u for n, u in parts) == text.replace(" ", "")
    if not parts or not whole or any(u and u not in TIME_UNITS for _, u in parts):
        raise ValueError(f"not a systemd time span: {text!r}")
    return sum(float(n) * TIME_UNITS[u or "s"] for n, u in parts)


def syscall_groups(systemd_analyze: str) -> dict[str, set[str]]:
    """Every @group of `systemd-analyze syscall-filter`, nested groups left as "@name"."""
    out = run_tool(systemd_analyze, "syscall-filter").stdout
    groups: dict[str, set[str]] = {}
    current: set[str] | None = None
    for line in out.splitlines():
        if line.startswith("@"):
            current = groups.setdefault(line.strip(), set())
        elif current is not None and line.strip() and not line.strip().startswith("#"):
            current.add(line.strip())
    return groups


def expand_syscalls(names: list[str], groups: dict[str, set[str]]) -> set[str]:
    result: set[str] = set()
    for name in names:
        if name.startswith("@"):
            result |= expand_syscalls(sorted(groups[name]), groups)
        else:
            result.add(name)
    return result


def allowed_syscalls(filters: list[str], groups: dict[str, set[str]]) -> set[str]:
    """The allow list that SystemCallFilter= lines (in order) leave, as systemd merges them:
    the first line must be an allow list; "~" lines remove from it, later lines add back."""
    assert filters and not filters[0].startswith("~"), "SystemCallFilter= must start allowing"
    allowed: set[str] = set()
    for line in filters:
        deny = line.startswith("~")
        names = expand_syscalls(line.removeprefix("~").split(), groups)
        allowed = allowed - names if deny else allowed | names
    return allowed


# --- the environment file and the CLI ----------------------------------------------------------

SETTING = re.compile(r"^#([A-Z][A-Z0-9_]*)=(.*)$")
ACTIVE = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*=")


def env_settings(text: str) -> dict[str, str]:
    """Commented-out settings `#NAME=default` of the env file, in order."""
    found = {}
    for line in text.splitlines():
        match = SETTING.match(line)
        if match:
            assert match.group(1) not in found, f"{match.group(1)} is set twice"
            found[match.group(1)] = match.group(2)
    return found


def serve_parser() -> argparse.ArgumentParser:
    from cpud.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices["serve"]


def serve_defaults(monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """`cpud serve` settings with no flags and no cpud/vLLM variables in the environment."""
    for name in list(os.environ):
        if name.startswith(("CPUD_", "VLLM_", "CPU_VISIBLE")):
            monkeypatch.delenv(name)
    return serve_parser().parse_args([])


# --- metrics -----------------------------------------------------------------------------------


class _AnyStats:
    """Stands in for engine and rank statistics: every field reads 0."""

    rank = 0
    numa_node = 0

    def __getattr__(self, name: str) -> int:
        return 0


class _FakeEngine:
    def __init__(self):
        from cpud.structured.compiler import GrammarCompiler

        self.engine = self
        self.executor = self
        self.grammars = GrammarCompiler(tokenizer=None)  # its statistics, nothing compiled
        self.spec = None  # no speculative decoding

    def stats(self) -> _AnyStats:
        return _AnyStats()

    def rank_stats(self) -> list[_AnyStats]:
        return [_AnyStats()]


def exported_samples() -> tuple[set[str], set[str]]:
    """(sample names, label names) a frontend registry exports, with one child per labelled
    metric so its labels show."""
    from prometheus_client.metrics import MetricWrapperBase

    from cpud.frontend.metrics import FrontendMetrics

    metrics = FrontendMetrics()
    metrics.watch(_FakeEngine())
    for metric in vars(metrics).values():
        if isinstance(metric, MetricWrapperBase) and metric._labelnames:
            metric.labels(*["x"] * len(metric._labelnames))
    names, labels = set(), set()
    for family in metrics.registry.collect():
        for sample in family.samples:
            names.add(sample.name)
            labels.update(sample.labels)
    return names, labels


# Labels Prometheus adds to every scraped series.
TARGET_LABELS = {"job", "instance"}

CPUD_NAME = re.compile(r"\bcpud_[a-z0-9_]+\b")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")


def promql_metric_names(expr: str) -> set[str]:
    return set(CPUD_NAME.findall(expr))


def promql_label_names(expr: str) -> set[str]:
    """Labels named in matchers and by/on/without/ignoring clauses of a PromQL expression."""
    labels = set()
    for group in GROUPING.findall(expr):
        labels.update(name.strip() for name in group.split(",") if name.strip())
    for selector in re.findall(r"\{([^}]*)\}", expr):
        labels.update(MATCHER.findall(selector))
    return labels
