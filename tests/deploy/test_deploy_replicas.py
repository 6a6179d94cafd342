"""deploy/cpud@.service (one replica per NUMA node) and deploy/cpud-router.service: valid for
systemd, as hardened as cpud.service, and in agreement with cpud and vllm-router."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from deploy_helpers import DEPLOY, UNIT, parse_unit, require_tool, run_tool

from cpud_server_helpers import Server, free_port, wait_healthy

TEMPLATE = DEPLOY / "cpud@.service"
ROUTER = DEPLOY / "cpud-router.service"
SHIPPED_BIN = "/opt/cpud/venv/bin"
MAX_EXPOSURE = 2.0
# What a replica instance sets differently from the single cpud.service, and nothing else.
INSTANCE_KEYS = {"EnvironmentFile", "Environment", "User", "Group", "RuntimeDirectory"}


def installed(name: str) -> str:
    beside_python = Path(sys.executable).with_name(name)
    found = str(beside_python) if beside_python.exists() else shutil.which(name)
    assert found, f"{name} is not installed"
    return found


def local_copy(unit: Path, directory: Path) -> Path:
    """The unit with the shipped binaries replaced by this machine's (verify checks they exist)."""
    text = unit.read_text()
    for name in ("cpud", "vllm-router"):
        text = text.replace(f"{SHIPPED_BIN}/{name} ", f"{installed(name)} ")
    path = directory / unit.name
    path.write_text(text)
    return path


def clean(result) -> None:
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 0 and not output, output


def test_systemd_analyze_verify_is_clean(tmp_path):
    analyze = require_tool("systemd-analyze")
    local_copy(TEMPLATE, tmp_path)
    router = local_copy(ROUTER, tmp_path)
    # A template is verified through its instances.
    clean(run_tool(analyze, "verify", tmp_path / "cpud@0.service", tmp_path / "cpud@1.service"))
    clean(run_tool(analyze, "verify", router))


@pytest.mark.parametrize("name", ["cpud@0.service", "cpud-router.service"])
def test_security_exposure_is_low(tmp_path, name):
    analyze = require_tool("systemd-analyze")
    local_copy(TEMPLATE, tmp_path)
    local_copy(ROUTER, tmp_path)
    result = run_tool(analyze, "security", "--offline=yes", tmp_path / name)
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= MAX_EXPOSURE, result.stdout


def test_a_replica_instance_is_cpud_service_on_one_node():
    single = parse_unit(UNIT.read_text())["Service"]
    instance = parse_unit(TEMPLATE.read_text())["Service"]
    differing = {k for k in set(single) | set(instance) if single.get(k) != instance.get(k)}
    assert differing == INSTANCE_KEYS  # hardening and lifecycle cannot drift apart
    assert "CPU_VISIBLE_MEMORY_NODES=%i" in instance["Environment"]
    assert "CPUD_DATA_PARALLEL_RANK=%i" in instance["Environment"]
    assert instance["EnvironmentFile"] == ["-/etc/cpud/cpud.env", "/etc/cpud/replica-%i.env"]
    assert instance["RuntimeDirectory"] == ["cpud-%i"]
    # one dynamic user for every instance: they share the model and cache directories
    assert instance["User"] == ["cpud"] and instance["DynamicUser"] == ["yes"]


def router_argv(service: dict[str, list[str]]) -> list[str]:
    """ExecStart's words after the binary, with the unit's own Environment= defaults."""
    env = dict(shlex.split(value)[0].split("=", 1) for value in service["Environment"])
    (command,) = service["ExecStart"]

    def expand(match: re.Match) -> str:
        return env[match.group(1) or match.group(2)]

    words = []
    for word in command.split()[1:]:
        value = re.sub(r"\$\{(\w+)\}|\$(\w+)", expand, word)
        words += value.split() if word.startswith("$") and not word.startswith("${") else [value]
    return words


def test_router_unit_runs_vllm_router_in_front_of_the_replicas():
    from vllm_router.launch_router import parse_router_args

    service = parse_unit(ROUTER.read_text())["Service"]
    assert service["ExecStart"][0].startswith(f"{SHIPPED_BIN}/vllm-router ")
    parsed = parse_router_args(router_argv(service))
    assert parsed.policy == "cache_aware"
    assert parsed.worker_urls == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert parsed.port == 8000 and parsed.port not in (8001, 8002)
    # replica N listens on 8001 + N, as the template's comment has it
    assert "$((8001 + N))" in TEMPLATE.read_text()
    assert service["Restart"] == ["always"]


@pytest.mark.slow
def test_an_instance_labels_its_metrics_and_logs_with_its_replica(model_factory, tmp_path):
    """cpud@1 as systemd starts it (its Environment= lines with %i = 1, its port from the
    instance's env file): metrics carry replica="1", as -dp labels its replicas, and the
    supervisor, the frontend and the rank tag their log lines. (This host has one NUMA node:
    the node binding is left out.)"""
    service = parse_unit(TEMPLATE.read_text())["Service"]
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "CPUD_CACHE_DIR": str(tmp_path)}
    for line in service["Environment"]:
        name, value = line.replace("%i", "1").split("=", 1)
        if name == "CPUD_DATA_PARALLEL_RANK":
            env[name] = value
    port = free_port()
    env |= {"CPUD_PORT": str(port), "CPUD_MODEL": str(model_factory("qwen3"))}
    env |= {"CPUD_SERVED_MODEL_NAME": "tiny", "CPUD_MAX_MODEL_LEN": "256"}
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([installed("cpud"), "serve"], env=env, stdout=log, stderr=log)
    server = wait_healthy(Server(proc, f"http://127.0.0.1:{port}", log_path))
    try:
        body = {"model": "tiny", "prompt": "unit", "max_tokens": 2}
        assert httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).is_success
        metrics = httpx.get(server.base_url + "/metrics").text
        requests = [m for m in metrics.splitlines() if m.startswith("cpud_requests_total{")]
        assert requests and all('replica="1"' in m for m in requests), requests
    finally:
        assert server.stop() == 0
    text = log_path.read_text()
    writers = ("cpud.supervisor", "cpud.access", r"rank \d+")  # supervisor, frontend, rank
    for writer in writers:
        assert re.search(writer + r"\[replica 1\] ", text), (writer, text[-3000:])


def test_a_rank_is_not_given_beside_a_replica_count():
    from cpud.cli import build_parser
    from cpud.settings.errors import ConfigError
    from cpud.settings.serve_flags import serve_args

    parser = build_parser()
    assert serve_args(parser.parse_args(["serve", "-dpr", "3"])).replica == 3
    with pytest.raises(ConfigError, match="--data-parallel-rank .* --data-parallel-size 2"):
        serve_args(parser.parse_args(["serve", "-dpr", "1", "-dp", "2"]))
    with pytest.raises(ConfigError, match="--data-parallel-rank must be 0 or more"):
        serve_args(parser.parse_args(["serve", "--data-parallel-rank", "-1"]))
