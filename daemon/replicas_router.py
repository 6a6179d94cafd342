"""vLLM's router (`vllm-router`, an optional dependency) in front of the replicas: its command
line and a check that it is installed. cpud grows no balancer of its own."""

from __future__ import annotations

import importlib.util
import shlex

from cpud.engine.kv_events import KVEventsConfig
from cpud.placement.replicas import ReplicaPlan
from cpud.process.child_process import module_command
from cpud.settings.errors import ConfigError

ROUTER_MODULE = "vllm_router"
INSTALL_HINT = "pip install vllm-router (cpud's `router` extra)"
# cpud's defaults, before --router-args (a flag given twice: the later one wins): the policy for
# chat and agent traffic, workers checked every second while they start and every 5 s after, and
# a replica's circuit closed again 10 s after it opened (a lost replica restarts in seconds).
DEFAULT_ARGS = (
    "--policy",
    "cache_aware",
    "--worker-startup-check-interval",
    "1",
    "--health-check-interval-secs",
    "5",
    "--cb-timeout-duration-secs",
    "10",
    "--log-level",
    "warning",
)


def check_router_installed() -> None:
    if importlib.util.find_spec(ROUTER_MODULE) is None:
        raise ConfigError(f"--router needs vLLM's router, which is not installed: {INSTALL_HINT}")


def extra_args(text: str | None) -> list[str]:
    try:
        return shlex.split(text or "")
    except ValueError as exc:
        raise ConfigError(f"--router-args {text!r}: {exc}: quote it as a shell would") from None


def connectable(endpoint: str) -> str:
    """A ZeroMQ endpoint a publisher binds, as a subscriber on this host connects to it."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
        if endpoint.startswith(wildcard):
            return "tcp://127.0.0.1:" + endpoint.removeprefix(wildcard)
    return endpoint


def kv_event_args(
    plan: ReplicaPlan, kv_events: KVEventsConfig, model_name: str, block_size: int
) -> list[str]:
    """The router's static KV-event sources: replica i's publisher (--kv-events-config's
    endpoints moved up by i), for its kv_aware policy; none while events are off."""
    if not kv_events.enabled:
        return []
    args = ["--kv-event-model", model_name, "--kv-event-block-size", str(block_size)]
    for replica in plan.replicas:
        own = kv_events.for_replica(replica.index)
        args += ["--kv-event-source", f"{replica.url}={connectable(own.endpoint)}"]
        if own.replay_endpoint is not None:
            replay = connectable(own.replay_endpoint)
            args += ["--kv-event-replay-source", f"{replica.url}={replay}"]
    return args


def router_command(
    plan: ReplicaPlan, router_args: str | None, kv_sources: list[str] | None = None
) -> list[str]:
    """argv of the router on the plan's router address with every replica as a worker
    (`kv_sources`: kv_event_args)."""
    if plan.router_port is None:
        raise ValueError("the plan has no router")
    return module_command(
        f"{ROUTER_MODULE}.launch_router",
        "--host",
        str(plan.router_host),
        "--port",
        str(plan.router_port),
        "--worker-urls",
        *(replica.url for replica in plan.replicas),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(plan.router_metrics_port),
        *DEFAULT_ARGS,
        *(kv_sources or ()),
        *extra_args(router_args),
    )
