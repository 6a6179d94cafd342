"""`cpud doctor --data-parallel-size N` on fabricated machines: the split of the host into
replicas, each replica's memory plan, and the refusals."""

from __future__ import annotations

import json

import pytest
from placement.fake_sysfs import Machine, write_machine
from test_doctor import FakeSyscalls, doctor_cli, rank_cpus

from cpud.doctor.inputs import DoctorInputs
from cpud.doctor.report import Check
from cpud.doctor.run import collect
from cpud.fixtures import default_model_dir
from cpud.placement.binding import BIND_ENV, RESERVED_ENV, VISIBLE_NODES_ENV
from cpud.settings.config import EngineArgs

# 2 sockets x 16 cores x SMT2 (siblings +32); and 4 nodes of 16 cores (siblings +64).
TWO_NODES = Machine(sockets=2, cores_per_node=16, smt=2)
FOUR_NODES = Machine(sockets=2, nodes_per_socket=2, cores_per_node=16, smt=2)
SMALL = Machine(cores_per_node=2)


@pytest.fixture(autouse=True)
def no_placement_env(monkeypatch):
    for name in (BIND_ENV, RESERVED_ENV, VISIBLE_NODES_ENV, "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(name, raising=False)


def doctor(tmp_path, machine: Machine, dp: int, **engine) -> dict[str, Check]:
    sys_root, proc_root = write_machine(tmp_path, machine)
    engine.setdefault("model", default_model_dir())
    inputs = DoctorInputs(
        engine=EngineArgs(**engine),
        sysfs_root=sys_root,
        proc_root=proc_root,
        syscalls=FakeSyscalls(frozenset(machine.cpus)),
        data_parallel_size=dp,
    )
    checks = collect(inputs)
    names = [c.name for c in checks]
    if dp != 1:
        assert names.index("replicas") == names.index("memory plan") + 1
    else:
        assert "replicas" not in names
    return {c.name: c for c in checks}


def test_two_nodes_dp2_tp2_one_replica_per_node(tmp_path):
    checks = doctor(tmp_path, TWO_NODES, 2, tp=2)
    replicas = checks["replicas"]
    assert replicas.status in ("ok", "warn"), replicas
    rows = replicas.value["replicas"]
    assert [r["numa_nodes"] for r in rows] == [[0], [1]]
    assert rows[1]["rank_cpus"] == [list(range(16, 24)), list(range(24, 32))]
    assert [r["url"] for r in rows] == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    assert all(r["num_kv_blocks"] > 0 for r in rows)
    assert replicas.summary.startswith("2 replicas x 2 rank(s): 0 on node(s) 0; 1 on node(s) 1")
    # the binding and memory items show replica 0: its two ranks on node 0
    assert rank_cpus(checks["binding"]) == [tuple(range(0, 8)), tuple(range(8, 16))]
    assert checks["memory plan"].status == "ok"


def test_four_nodes_dp2_tp2_pairs_of_nodes(tmp_path):
    checks = doctor(tmp_path, FOUR_NODES, 2, tp=2)
    rows = checks["replicas"].value["replicas"]
    assert [r["numa_nodes"] for r in rows] == [[0, 1], [2, 3]]
    assert checks["replicas"].status == "ok"
    assert any(
        line.startswith("replica 1: 2 rank(s) on NUMA node(s) 2,3")
        for line in checks["replicas"].details
    )


def test_more_replicas_than_cores_fails_with_the_binding(tmp_path):
    checks = doctor(tmp_path, SMALL, 3)
    assert checks["replicas"].status == "fail"
    assert "needs one physical core per rank" in checks["replicas"].value["error"]
    assert checks["binding"].status == "fail"


def test_a_replica_whose_share_of_memory_is_too_small_fails(tmp_path):
    # one node with 1 GiB available: enough for one replica, not for two halves
    tight = Machine(cores_per_node=16, mem_free_gib=0, file_gib=1, sreclaimable_gib=0)
    checks = doctor(tmp_path, tight, 2)
    replicas = checks["replicas"]
    assert replicas.status == "fail" and replicas.summary == "a replica does not fit"
    assert replicas.advice[0].startswith("replica 0: rank 0 on NUMA node 0 needs")
    assert checks["memory plan"].status == "fail"
    alone = doctor(tmp_path / "alone", tight, 1)
    assert alone["memory plan"].status == "ok"


@pytest.mark.slow
def test_the_cli_reports_the_split_of_this_machine():
    result = doctor_cli("-dp", "2", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    rows = checks["replicas"]["value"]["replicas"]
    assert [r["replica"] for r in rows] == [0, 1]
    cpus = [cpu for r in rows for ranks in r["rank_cpus"] for cpu in ranks]
    assert cpus and len(cpus) == len(set(cpus))  # no CPU in two replicas
    assert doctor_cli("-dp", "1000").returncode == 1  # more replicas than cores
