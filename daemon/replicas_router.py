"""vLLM's router (`vllm-router`, an optional dependency) in front of the replicas: its command
line and a check that it is installed. cpud grows no balancer of its own."""

from __future__ import annotations

import importlib.util
import shlex

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


def router_command(plan: ReplicaPlan, router_args: str | None) -> list[str]:
    """argv of the router on the plan's router address with every replica as a worker."""
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
        *extra_args(router_args),
    )
