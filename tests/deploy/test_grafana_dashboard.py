"""deploy/grafana/cpud-dashboard.json: importable with a Prometheus data source input, valid
PromQL, only metrics and labels cpud exports, and the panels issue #6 asks for."""

from __future__ import annotations

import json
import re
from itertools import product

import pytest
import yaml
from deploy_helpers import (
    DASHBOARD,
    TARGET_LABELS,
    exported_samples,
    promql_label_names,
    promql_metric_names,
    require_tool,
    run_tool,
)

DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
# Values Grafana substitutes for its variables, so promtool can parse the expressions.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$instance": ".*", "$rank": ".*"}
REQUIRED = {
    "cpud_requests_total",
    "cpud_requests_running",
    "cpud_requests_waiting",
    "cpud_kv_cache_usage_ratio",
    "cpud_time_to_first_token_seconds_bucket",
    "cpud_inter_token_latency_seconds_bucket",
    "cpud_e2e_request_latency_seconds_bucket",
    "cpud_generation_tokens_total",
}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def graphs(dashboard) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


@pytest.fixture(scope="module")
def exprs(graphs) -> list[str]:
    return [target["expr"] for panel in graphs for target in panel["targets"]]


def test_importable_with_a_prometheus_input(dashboard, graphs):
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["uid"] and dashboard["title"]
    (source,) = dashboard["__inputs"]
    assert (source["name"], source["type"], source["pluginId"]) == (
        "DS_PROMETHEUS",
        "datasource",
        "prometheus",
    )
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    for panel in graphs:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]


def test_panel_layout(dashboard):
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells = set()
    for panel in panels:
        box = panel["gridPos"]
        assert box["x"] + box["w"] <= 24, panel["title"]
        area = set(
            product(range(box["x"], box["x"] + box["w"]), range(box["y"], box["y"] + box["h"]))
        )
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area


def test_expressions_are_valid_promql(exprs, dashboard, tmp_path):
    promtool = require_tool("promtool")
    queries = list(exprs)
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((.+), *\w+\)", variable["definition"])
            assert match, variable["definition"]
            queries.append(match.group(1))
    for name, value in GRAFANA_VARIABLES.items():
        queries = [q.replace(name, value) for q in queries]
    assert not [q for q in queries if "$" in q], "unknown Grafana variable"
    rules = [{"record": f"dashboard:query_{i}", "expr": q} for i, q in enumerate(queries)]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = run_tool(promtool, "check", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_uses_only_exported_metrics_and_labels(exprs, graphs, dashboard):
    samples, labels = exported_samples()
    queries = exprs + [
        v["definition"] for v in dashboard["templating"]["list"] if "definition" in v
    ]
    for expr in queries:
        assert promql_metric_names(expr) <= samples, (
            f"{expr}: {promql_metric_names(expr) - samples}"
        )
        unknown = promql_label_names(expr) - labels - TARGET_LABELS - {"le"}
        assert not unknown, f"{expr} uses labels cpud does not export: {unknown}"
    for panel in graphs:
        for target in panel["targets"]:
            legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
            assert legend <= labels | TARGET_LABELS, f"{panel['title']}: {legend}"


def test_covers_requests_latency_and_every_rank_series(exprs, graphs):
    from cpud.frontend.metrics import RANK_SERIES

    used = set().union(*(promql_metric_names(e) for e in exprs))
    assert REQUIRED - used == set()
    rank_families = {name for name, *_ in RANK_SERIES}
    rank_used = {re.sub(r"_total$", "", name) for name in used if name.startswith("cpud_rank_")}
    assert rank_families - rank_used == set(), "per-rank series without a panel"
    for family in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        quantiles = {
            q for e in exprs for q in re.findall(rf"histogram_quantile\((0\.\d+), .*{family}", e)
        }
        assert quantiles == {"0.5", "0.99"}, family


def test_rank_panels_tell_ranks_apart(graphs):
    for panel in graphs:
        for target in panel["targets"]:
            if "cpud_rank_" in target["expr"]:
                assert "{{rank}}" in target["legendFormat"], panel["title"]
                assert "{{numa_node}}" in target["legendFormat"], panel["title"]
                assert "sum(" not in target["expr"], f"{panel['title']} sums the ranks away"
