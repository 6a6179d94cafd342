"""The launch seam: the specs processes start with, the config resolved once and carried typed,
one planning entry, the EngineArgs fields listed once, and no import cycle through it."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from cpud.protocol.launch import EngineSpec, FrontendSpec, RankSlot, RankSpec
from cpud.settings.config import (
    EngineArgs,
    EngineConfig,
    ServeArgs,
    config_from_spec,
    engine_kwargs,
)

REPO = Path(__file__).resolve().parent.parent
PACKAGES = {"cpud": "daemon", "cpud.ranks": "ranks", "cpud.protocol": "protocol"}


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if package == "cpud" and parts and parts[0] in ("ranks", "protocol", "native"):
                continue
            found[".".join([package, *parts])] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the cpud modules it imports anywhere, inside functions included."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.add(node.module)
                targets |= {f"{node.module}.{alias.name}" for alias in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while (member := stack.pop()) != node:
                component.add(member)
            if component:
                found.append(component | {node})

    for node in graph:
        if node not in index:
            visit(node)
    return found


def reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def test_no_import_cycle_anywhere():
    graph = import_graph()
    assert "cpud.ranks.worker" in graph and "cpud.engine.multiproc" in graph
    assert "cpud.ranks.layers.attention" in graph and "cpud.model.gguf_model" in graph
    assert cycles(graph) == []


# The torch-free part of the ranks the control plane reads configs through: the family
# registry and the family modules (config mappings and recipes), the checkpoint views they
# hand the loader (expert_views), and their empty packages.
FAMILY_MODULES = (
    "cpud.ranks",
    "cpud.ranks.models",
    "cpud.ranks.models.registry",
    "cpud.ranks.models.family",
    "cpud.ranks.models.expert_views",
)


def is_family_module(name: str) -> bool:
    return name in FAMILY_MODULES or name.startswith("cpud.ranks.models.families")


def test_model_facts_never_import_the_ranks():
    """...but for the family registry and modules, which import only cpud.model and settings."""
    graph = import_graph()
    for name in (m for m in graph if m.startswith("cpud.model")):
        ranks = {t for t in graph[name] if t.startswith("cpud.ranks")}
        assert not {t for t in ranks if not is_family_module(t)}, name
    owners = ["cpud.settings.config", *(m for m in graph if m.startswith("cpud.placement"))]
    assert "cpud.placement.memory_plan" in owners
    for owner in owners:
        reached = {m for m in reaches(graph, owner) if m.startswith("cpud.ranks")}
        assert not {m for m in reached if not is_family_module(m)}, owner
    for name in (m for m in graph if is_family_module(m)):
        outside = {t for t in graph[name] if t.startswith("cpud.ranks") and not is_family_module(t)}
        assert not outside, name
        assert all(
            t.startswith(("cpud.model", "cpud.settings.errors", "cpud.ranks")) for t in graph[name]
        )


def test_ranks_never_import_the_engine_or_the_frontend():
    graph = import_graph()
    owners = ("cpud.engine", "cpud.frontend", "cpud.supervisor", "cpud.llm")
    for name in (m for m in graph if m.startswith("cpud.ranks")):
        assert not {t for t in graph[name] if t.startswith(owners)}, name
    reached = reaches(graph, "cpud.ranks.worker")
    assert not {m for m in reached if m.startswith(owners)}


def test_protocol_imports_nothing_of_cpud_but_protocol():
    graph = import_graph()
    for name in (m for m in graph if m.startswith("cpud.protocol")):
        assert all(t.startswith("cpud.protocol") for t in graph[name]), (name, graph[name])


def test_the_frontend_does_not_resolve_the_config_again():
    graph = import_graph()
    tree = ast.parse((REPO / "daemon/frontend/server.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert "resolve_config" not in names and "config_from_spec" in names
    assert "cpud.model.model_dir" not in graph["cpud.frontend.server"]


def test_the_engine_spec_carries_every_setting_of_the_config():
    config_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert config_fields == set(EngineSpec.__struct_fields__)


@pytest.fixture(scope="module")
def start_plan(model_factory):
    from cpud.placement.start import plan_start

    args = EngineArgs(dtype="float32", kv_cache_fraction=0.001, max_num_seqs=100000)
    return plan_start(args, model_factory("llama"))


def test_the_resolved_config_travels_typed_and_comes_back_equal(start_plan):
    config = start_plan.config
    wire = msgspec.json.encode(config.spec())
    assert config_from_spec(msgspec.json.decode(wire, type=EngineSpec)) == config


def test_a_rank_spec_nests_the_engine_as_an_object(start_plan):
    slot = start_plan.slots[0]
    spec = RankSpec(0, 1, "/run/x", slot.cpus, slot.numa_node, "shm", start_plan.config.spec())
    decoded = msgspec.json.decode(msgspec.json.encode(spec))
    assert isinstance(decoded["engine"], dict)
    assert decoded["engine"]["num_kv_blocks"] == start_plan.config.num_kv_blocks
    assert msgspec.json.decode(msgspec.json.encode(spec), type=RankSpec) == spec


def test_the_frontend_spec_holds_the_sized_kv_cache_and_no_secret(start_plan):
    from cpud.frontend.server import frontend_spec

    args = EngineArgs(chat_template="{{ x }}", tool_call_parser="hermes", kv_cache_fraction=0.001)
    serve = ServeArgs(api_key="sk-secret", served_model_names=("a",))
    spec = frontend_spec("/run/x", start_plan.config, args, serve)
    wire = msgspec.json.encode(spec)
    assert b"sk-secret" not in wire and b"kv_cache_fraction" not in wire
    back = msgspec.json.decode(wire, type=FrontendSpec[ServeArgs])
    assert back.engine.num_kv_blocks == start_plan.config.num_kv_blocks
    assert back.serve_args == dataclasses.replace(serve, api_key=None)
    bad = wire.replace(b'"drain_timeout":30.0', b'"drain_timeout":-1.0')
    with pytest.raises(msgspec.ValidationError, match="--drain-timeout must be a positive number"):
        msgspec.json.decode(bad, type=FrontendSpec[ServeArgs])
    assert (back.chat_template, back.tool_call_parser) == ("{{ x }}", "hermes")
    assert back.model_name == "smollm2-135m-instruct"


def test_a_kv_fraction_sizes_the_cache_with_one_binding_plan(model_factory, monkeypatch):
    from cpud.placement import start

    calls = []
    original = start.plan_binding

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(start, "plan_binding", counted)
    small = start.plan_start(
        EngineArgs(dtype="float32", kv_cache_fraction=0.001, max_num_seqs=100000),
        model_factory("llama"),
    )
    assert len(calls) == 1
    large = start.plan_start(
        EngineArgs(dtype="float32", kv_cache_fraction=0.002, max_num_seqs=100000),
        model_factory("llama"),
    )
    assert large.config.num_kv_blocks > small.config.num_kv_blocks > 1
    assert small.memory.num_kv_blocks == small.config.num_kv_blocks
    assert small.slots == [RankSlot(list(r.cpus) or None, r.numa_node) for r in small.binding.ranks]


def test_doctor_plans_what_serve_would(model_factory):
    from cpud.doctor.inputs import DoctorInputs
    from cpud.doctor.planning import plan
    from cpud.placement.start import plan_start

    args = EngineArgs(
        model=model_factory("llama"), dtype="float32", kv_cache_fraction=0.001, max_num_seqs=10**5
    )
    doctor = plan(DoctorInputs(engine=args)).config
    serve = plan_start(args, Path(args.model)).config
    # A KV fraction is of the memory available at each call, which other processes move a little.
    assert abs(doctor.num_kv_blocks - serve.num_kv_blocks) <= max(2, serve.num_kv_blocks // 100)
    assert doctor == dataclasses.replace(serve, num_kv_blocks=doctor.num_kv_blocks)


def test_every_engine_setting_has_a_serve_flag_and_reaches_doctor():
    from cpud.cli import build_parser
    from cpud.doctor.args import inputs_from_args

    serve = build_parser().parse_args(["serve"])
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(engine_kwargs(vars(serve))) == fields - {"model", "num_kv_blocks"}
    argv = ["doctor", "--kv-cache-fraction", "0.5", "--kernels", "torch", "--collective", "gloo"]
    engine = inputs_from_args(build_parser().parse_args(argv)).engine
    assert (engine.kv_cache_fraction, engine.kernels, engine.collective) == (0.5, "torch", "gloo")


def test_the_model_facts_load_without_torch():
    names = sorted(m for m in import_graph() if m.startswith("cpud.model."))
    assert "cpud.model.model_config" in names and "cpud.model.gguf_model" in names
    code = f"import sys\nfor n in {names!r}: __import__(n)\nprint('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False", done.stderr
