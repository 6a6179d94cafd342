"""deploy/prometheus: promtool accepts the config and rules, the alert unit tests pass, and the
rules use only metrics and labels cpud exports."""

from __future__ import annotations

import re
import shutil

import pytest
import yaml
from deploy_helpers import (
    PROMETHEUS,
    TARGET_LABELS,
    exported_samples,
    promql_label_names,
    promql_metric_names,
    require_tool,
    run_tool,
    serve_defaults,
)

CONFIG = PROMETHEUS / "prometheus.yml"
RULES = PROMETHEUS / "cpud-alerts.yml"
RULE_TESTS = PROMETHEUS / "cpud-alerts.test.yml"
REQUIRED_ALERTS = {
    "CpudDown",
    "CpudRankStalled",
    "CpudRankThreadsIdle",
    "CpudKVCacheNearlyFull",
    "CpudTimeToFirstTokenHigh",
}


@pytest.fixture(scope="module")
def promtool() -> str:
    return require_tool("promtool")


@pytest.fixture(scope="module")
def rules() -> list[dict]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


def test_config_is_valid(promtool):
    result = run_tool(promtool, "check", "config", CONFIG)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout


def test_bearer_token_option_is_valid_once_uncommented(promtool, tmp_path):
    for path in (CONFIG, RULES):
        shutil.copy(path, tmp_path / path.name)
    key = tmp_path / "cpud-api-key"
    key.write_text("secret\n")
    text = CONFIG.read_text()
    uncommented = re.sub(
        r"(?m)^    # ( *)(authorization:|type:|credentials_file:)", r"    \1\2", text
    )
    uncommented = uncommented.replace("/etc/prometheus/cpud-api-key", str(key))
    assert uncommented != text
    (tmp_path / CONFIG.name).write_text(uncommented)
    result = run_tool(promtool, "check", "config", tmp_path / CONFIG.name)
    assert result.returncode == 0, result.stdout + result.stderr
    job = yaml.safe_load(uncommented)["scrape_configs"][0]
    assert job["authorization"] == {"type": "Bearer", "credentials_file": str(key)}


def test_scrapes_the_daemon_default_address(monkeypatch):
    defaults = serve_defaults(monkeypatch)
    config = yaml.safe_load(CONFIG.read_text())
    assert config["global"]["scrape_interval"] == "15s"
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "cpud"
    assert job["static_configs"][0]["targets"] == [f"{defaults.host}:{defaults.port}"]


def test_rules_are_valid(promtool):
    result = run_tool(promtool, "check", "rules", RULES)
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_unit_tests_pass(promtool):
    result = run_tool(promtool, "test", "rules", RULE_TESTS.name, cwd=PROMETHEUS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_is_tested_firing_and_quiet(rules):
    names = {rule["alert"] for rule in rules}
    assert REQUIRED_ALERTS <= names
    cases = [
        case
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test["alert_rule_test"]
    ]
    fires = {case["alertname"] for case in cases if case["exp_alerts"]}
    quiet = {case["alertname"] for case in cases if not case["exp_alerts"]}
    assert names - fires == set(), "alerts never seen firing"
    assert names - quiet == set(), "alerts never checked quiet"


def test_rules_use_exported_metrics_and_labels(rules):
    samples, labels = exported_samples()
    for rule in rules:
        expr = rule["expr"]
        used = promql_metric_names(expr)
        assert used or re.match(r"up\{", expr), f"{rule['alert']} uses no cpud metric"
        assert used <= samples, f"{rule['alert']}: {sorted(used - samples)}"
        unknown = promql_label_names(expr) - labels - TARGET_LABELS - {"le"}
        assert not unknown, f"{rule['alert']} uses labels cpud does not export: {unknown}"
        for text in rule.get("annotations", {}).values():
            named = set(re.findall(r"\$labels\.([a-z_]+)", text))
            assert named <= labels | TARGET_LABELS, f"{rule['alert']}: {named}"
