"""deploy/k8s: valid against the Kubernetes OpenAPI schemas (kubernetes-validate), and in
agreement with cpud and with vllm-router's own flag parser."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from deploy_helpers import DEPLOY, serve_defaults

from cpud.cli import serve_env_vars

K8S = DEPLOY / "k8s"
# The schema version the manifests are checked against (the newest the package ships).
KUBERNETES_VERSION = kubernetes_validate.latest_version()
# Variables the worker sets that are not serve flags, with what reads them.
OTHER_VARIABLES = {"CPUD_CACHE_DIR", "RUNTIME_DIRECTORY"}


def documents() -> list[tuple[Path, dict]]:
    found = []
    for path in sorted(K8S.glob("*.yaml")):
        found += [(path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


def component_of(doc: dict) -> str | None:
    return doc["metadata"].get("labels", {}).get("app.kubernetes.io/component")


def one(kind: str, component: str | None = None) -> dict:
    matches = [
        doc
        for _, doc in documents()
        if doc["kind"] == kind and component in (None, component_of(doc))
    ]
    assert len(matches) == 1, f"{kind} {component}: {len(matches)} found"
    return matches[0]


def container(workload: dict) -> dict:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


@pytest.mark.parametrize(
    "path, doc", documents(), ids=lambda v: v.name if isinstance(v, Path) else v.get("kind")
)
def test_each_manifest_is_valid_for_kubernetes(path, doc):
    # strict: a field the schema does not know (a typo) is an error, not ignored.
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_an_invalid_manifest_is_refused():
    broken = yaml.safe_load(yaml.safe_dump(one("StatefulSet")))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_workers_are_guaranteed_whole_cores_and_ready_on_health(monkeypatch):
    workers = one("StatefulSet")
    cpud = container(workers)
    resources = cpud["resources"]
    # Guaranteed QoS with integer CPUs: the static CPU manager gives exclusive cores, and the
    # topology manager can keep them and the memory on one NUMA node.
    assert resources["requests"] == resources["limits"]
    assert float(resources["requests"]["cpu"]).is_integer()
    port = cpud["ports"][0]["containerPort"]
    env = {e["name"]: e.get("value") for e in cpud["env"]}
    assert int(env["CPUD_PORT"]) == port and env["CPUD_HOST"] == "0.0.0.0"
    assert set(env) - set(serve_env_vars()) <= OTHER_VARIABLES
    for probe in ("readinessProbe", "startupProbe"):
        assert cpud[probe]["httpGet"]["path"] == "/health"
    # The drain ends before the kubelet kills the pod.
    grace = workers["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > serve_defaults(monkeypatch).drain_timeout + 10
    mounts = {m["mountPath"] for m in cpud["volumeMounts"]}
    assert {"/dev/shm", env["CPUD_CACHE_DIR"], env["RUNTIME_DIRECTORY"]} <= mounts
    assert "NUMA" in (K8S / "cpud.yaml").read_text()


def test_the_router_discovers_the_workers():
    from vllm_router.launch_router import parse_router_args

    workers = one("StatefulSet")
    router = one("Deployment", "router")
    args = container(router)["args"]
    parsed = parse_router_args(args)  # vllm-router's own parser accepts them
    assert parsed.service_discovery and parsed.policy == "cache_aware"
    assert parsed.selector == workers["spec"]["template"]["metadata"]["labels"]
    assert parsed.service_discovery_port == container(workers)["ports"][0]["containerPort"]
    assert container(router)["readinessProbe"]["httpGet"]["path"] == "/health"
    # its service account may watch pods
    account = router["spec"]["template"]["spec"]["serviceAccountName"]
    binding = one("RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    (rule,) = one("Role")["rules"]
    assert rule["resources"] == ["pods"] and {"list", "watch"} <= set(rule["verbs"])
    # the client-facing Service selects the router, the headless one the workers
    services = {d["metadata"]["name"]: d for _, d in documents() if d["kind"] == "Service"}
    assert services["cpud"]["spec"]["selector"] == router["spec"]["selector"]["matchLabels"]
    headless = services[workers["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"] == workers["spec"]["selector"]["matchLabels"]
