"""The pieces of data-parallel serving that run without a daemon: flags, the replica spec, the
router's command line, the replica label on metrics."""

from __future__ import annotations

import dataclasses
import socket
import sys
import time

import pytest
from prometheus_client import generate_latest

from cpud.cli import build_parser
from cpud.engine.kv_events import KVEventsConfig
from cpud.frontend.metrics import FrontendMetrics
from cpud.placement.replicas import plan_replicas
from cpud.placement.topology import discover_topology
from cpud.process.sd_notify import Notifier
from cpud.replicas import ReplicaSupervisor
from cpud.replicas_router import check_router_installed, kv_event_args, router_command
from cpud.replicas_spec import read_spec, replica_spec, write_spec
from cpud.settings.config import EngineArgs, ServeArgs
from cpud.settings.errors import ConfigError
from cpud.settings.serve_flags import serve_args


def host_plan(dp: int = 2, router: bool = False, port: int = 8000):
    return plan_replicas("nobind", None, 1, dp, discover_topology(), port=port, router=router)


def test_dp_flags_parse_into_serve_args():
    parsed = build_parser().parse_args(
        ["serve", "-dp", "2", "--router", "--router-args", "--policy round_robin"]
    )
    args = serve_args(parsed)
    assert (args.data_parallel_size, args.router, args.router_args) == (
        2,
        True,
        "--policy round_robin",
    )
    parsed = build_parser().parse_args(["serve", "--data-parallel-size", "3"])
    assert serve_args(parsed).data_parallel_size == 3
    assert build_parser().parse_args(["doctor", "-dp", "2"]).data_parallel_size == 2


def test_replica_spec_round_trip_keeps_no_key(tmp_path):
    plan = host_plan()
    engine = EngineArgs(model=tmp_path / "m", tp=1, bind="nobind")
    serve = ServeArgs(api_key="secret", port=8000, data_parallel_size=2, router=True)
    spec = replica_spec(engine, serve, plan.replicas[1])
    path = tmp_path / "replica1.json"
    write_spec(path, spec)
    assert b"secret" not in path.read_bytes()
    back = read_spec(str(path))
    assert EngineArgs(**back.engine_args) == dataclasses.replace(engine, model=str(tmp_path / "m"))
    assert back.serve_args.api_key is None
    assert (back.serve_args.port, back.serve_args.replica) == (8001, 1)
    assert (back.serve_args.data_parallel_size, back.serve_args.router) == (1, False)
    assert back.placement == plan.replicas[1]


def test_router_command_names_every_replica_and_appends_user_flags():
    plan = host_plan(router=True, port=9100)
    command = router_command(plan, "--policy round_robin --health-check-interval-secs 2")
    assert command[0] == sys.executable and "vllm_router.launch_router" in command
    at = command.index("--worker-urls")
    assert command[at + 1 : at + 3] == ["http://127.0.0.1:9101", "http://127.0.0.1:9102"]
    assert command[command.index("--port") + 1] == "9100"
    assert command[command.index("--prometheus-port") + 1] == "9103"
    # cpud's default policy first, the user's later (argparse keeps the last)
    policies = [command[i + 1] for i, word in enumerate(command) if word == "--policy"]
    assert policies == ["cache_aware", "round_robin"]
    with pytest.raises(ConfigError, match="--router-args"):
        router_command(plan, "--policy 'unterminated")


def test_missing_router_is_a_clear_error(monkeypatch):
    monkeypatch.setattr("cpud.replicas_router.ROUTER_MODULE", "no_such_router_module")
    with pytest.raises(ConfigError, match="pip install vllm-router"):
        check_router_installed()


def test_replica_metrics_carry_the_replica_label():
    metrics = FrontendMetrics(replica=1)
    metrics.requests.labels("/v1/completions", "200").inc()
    text = generate_latest(metrics.exposed).decode()
    assert 'cpud_requests_total{endpoint="/v1/completions",replica="1",status="200"} 1.0' in text
    assert all('replica="1"' in line for line in text.splitlines() if line and line[0] != "#")
    plain = generate_latest(FrontendMetrics().exposed).decode()
    assert "replica=" not in plain


def supervisor(model, **serve) -> ReplicaSupervisor:
    engine = EngineArgs(model=model, dtype="float32", bind="nobind")
    return ReplicaSupervisor(engine, ServeArgs(**serve), Notifier({}))


def test_the_host_plan_refuses_before_anything_starts(model_factory, monkeypatch):
    model = model_factory("qwen3")
    with pytest.raises(ConfigError, match="--data-parallel-size must be a positive"):
        supervisor(model, data_parallel_size=0).plan()
    too_many = ReplicaSupervisor(
        EngineArgs(model=model, dtype="float32"), ServeArgs(data_parallel_size=3), Notifier({})
    )
    with pytest.raises(ConfigError, match="needs one physical core per rank"):
        too_many.plan()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            supervisor(model, data_parallel_size=2, port=port).plan()
    monkeypatch.setattr("cpud.replicas_router.ROUTER_MODULE", "no_such_router_module")
    with pytest.raises(ConfigError, match="--router needs vLLM's router"):
        supervisor(model, data_parallel_size=2, router=True).plan()


def test_the_host_plan_checks_every_replica_and_the_router_port(model_factory):
    plan = supervisor(model_factory("qwen3"), data_parallel_size=2, router=True, port=9200).plan()
    assert [r.port for r in plan.replicas] == [9201, 9202]
    assert plan.router_port == 9200


def test_router_reads_each_replicas_kv_events_when_they_are_published():
    from vllm_router.launch_router import parse_router_args

    plan = host_plan(router=True, port=9300)
    assert kv_event_args(plan, KVEventsConfig(), "tiny", 16) == []
    events = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:5557")
    sources = kv_event_args(plan, events, "tiny", 32)
    command = router_command(plan, "--policy kv_aware", sources)
    parsed = parse_router_args(command[command.index("vllm_router.launch_router") + 1 :])
    assert parsed.policy == "kv_aware"
    assert parsed.kv_event_source == [
        "http://127.0.0.1:9301=tcp://127.0.0.1:5557",
        "http://127.0.0.1:9302=tcp://127.0.0.1:5558",
    ]
    assert (parsed.kv_event_block_size, parsed.kv_event_model) == (32, "tiny")
    assert parsed.worker_urls == ["http://127.0.0.1:9301", "http://127.0.0.1:9302"]


class ExitedProcess:
    def __init__(self, code: int):
        self.code = code

    def poll(self) -> int:
        return self.code


def test_a_lost_replica_restarts_with_backoff_until_it_gives_up(model_factory):
    from cpud.replicas import FIRST_BACKOFF_S, MAX_BACKOFF_S, MAX_FAILED_STARTS, Child

    top = supervisor(model_factory("qwen3"), data_parallel_size=2)
    child = Child("replica 1")
    backoffs = []
    for _ in range(MAX_FAILED_STARTS):
        child.proc = ExitedProcess(3)
        assert top._check_exit(child) is None  # restarted, the daemon goes on
        assert child.proc is None and not child.ready
        backoffs.append(child.start_at - time.monotonic())
    assert backoffs[0] == pytest.approx(FIRST_BACKOFF_S, abs=0.5)
    assert backoffs[1] == pytest.approx(2 * FIRST_BACKOFF_S, abs=0.5)
    assert max(backoffs) <= MAX_BACKOFF_S
    child.proc = ExitedProcess(3)
    assert top._check_exit(child) == 3  # too many starts in a row that never served
    # serving resets the count and the backoff
    child.failed_starts, child.backoff = 2, MAX_BACKOFF_S
    child.mark_ready()
    assert (child.failed_starts, child.backoff) == (0, FIRST_BACKOFF_S)
    # a replica that refuses its configuration stops every replica
    child.proc = ExitedProcess(2)
    assert top._check_exit(child) == 2
