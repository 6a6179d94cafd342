"""`cpud doctor` on fabricated machines (sysfs, procfs and cgroupfs trees, fake syscalls) and
on this machine: verdicts, advice, the exit-code contract and the two output formats."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from placement.fake_sysfs import GiB, Machine, write_cgroup_v2, write_machine

from cpud.cli import main
from cpud.doctor import syscalls
from cpud.doctor.inputs import DoctorInputs
from cpud.doctor.machine import dtype_check, huge_pages_check, native_check
from cpud.doctor.report import EXIT_FAIL, EXIT_OK, Check, exit_code, render, report
from cpud.doctor.run import collect
from cpud.doctor.runtime import openmp_check, openmp_runtimes
from cpud.fixtures import default_model_dir
from cpud.placement.binding import BIND_ENV, RESERVED_ENV, VISIBLE_NODES_ENV
from cpud.placement.cpulist import parse_cpulist
from cpud.settings.config import EngineArgs

ITEMS = (
    "cpud",
    "cpu",
    "native kernels",
    "dtype",
    "model",
    "smt",
    "huge pages",
    "numa",
    "cgroup",
    "binding",
    "memory plan",
    "openmp",
    "threads",
    "numa syscalls",
)
# 2 sockets x 16 cores x SMT2: node n holds cores 16n..16n+15, their siblings are +32.
TWO_SOCKETS = Machine(sockets=2, cores_per_node=16, smt=2)
# The same with 4 cores per node (siblings +8): too small to reserve a core per rank.
SMALL_TWO_SOCKETS = Machine(sockets=2, cores_per_node=4, smt=2)


@dataclass(frozen=True)
class FakeSyscalls:
    cpus: frozenset[int]
    # call name -> errno it fails with
    deny: tuple[tuple[str, int], ...] = ()

    def _call(self, name: str) -> None:
        for denied, code in self.deny:
            if denied == name:
                raise OSError(code, f"{name}: {os.strerror(code)}")

    def affinity(self) -> frozenset[int]:
        self._call("sched_getaffinity")
        return self.cpus

    def set_affinity(self, cpus: frozenset[int]) -> None:
        self._call("sched_setaffinity")

    def get_mempolicy(self) -> int:
        self._call("get_mempolicy")
        return 0

    def set_mempolicy_default(self) -> None:
        self._call("set_mempolicy")


@pytest.fixture(autouse=True)
def no_placement_env(monkeypatch):
    for name in (BIND_ENV, RESERVED_ENV, VISIBLE_NODES_ENV, "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(name, raising=False)


def run_doctor(
    tmp_path,
    machine: Machine,
    cgroup: dict[str, dict[str, str]] | None = None,
    deny: tuple[tuple[str, int], ...] = (),
    **engine,
) -> dict[str, Check]:
    sys_root, proc_root = write_machine(tmp_path, machine)
    if cgroup is not None:
        write_cgroup_v2(sys_root, proc_root, "/svc", cgroup)
    engine.setdefault("model", default_model_dir())  # a fixture that splits for any --tp here
    inputs = DoctorInputs(
        engine=EngineArgs(**engine),
        sysfs_root=sys_root,
        proc_root=proc_root,
        syscalls=FakeSyscalls(frozenset(machine.cpus), deny),
    )
    checks = collect(inputs)
    assert tuple(c.name for c in checks) == ITEMS
    return {c.name: c for c in checks}


def rank_cpus(check: Check) -> list[tuple[int, ...]]:
    return [parse_cpulist(r["cpus"]) for r in check.value["ranks"]]


# --- placement on fabricated machines ------------------------------------------------------


def test_two_sockets_smt2_tp2_auto_one_rank_per_node(tmp_path):
    checks = run_doctor(tmp_path, TWO_SOCKETS, tp=2)
    binding = checks["binding"]
    assert binding.status == "ok", binding
    # one thread per physical core, the last core of each node kept for the frontend
    assert rank_cpus(binding) == [tuple(range(0, 15)), tuple(range(16, 31))]
    assert [r["numa_node"] for r in binding.value["ranks"]] == [0, 1]
    assert binding.value["frontend"] == {"cpus": "15,31,47,63", "placement": "reserved"}
    numa = checks["numa"]
    assert [n["cpus"] for n in numa.value["nodes"]] == ["0-15,32-47", "16-31,48-63"]
    assert numa.value["nodes_without_cpus"] == []
    smt = checks["smt"].value
    assert (smt["threads_per_core"], smt["physical_cores_visible"], smt["cpus_visible"]) == (
        2,
        32,
        64,
    )
    assert checks["cpu"].value["sockets"] == 2
    assert checks["memory plan"].status == "ok" and checks["memory plan"].value["fits"]
    assert exit_code(list(checks.values())) == EXIT_OK


def test_small_nodes_frontend_on_smt_siblings_warns_with_the_flag(tmp_path):
    checks = run_doctor(tmp_path, SMALL_TWO_SOCKETS, tp=2)
    binding = checks["binding"]
    assert binding.status == "warn"
    assert rank_cpus(binding) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert binding.value["frontend"]["placement"] == "smt-siblings"
    assert any("--reserved-cpus 1" in a and RESERVED_ENV in a for a in binding.advice)
    assert exit_code(list(checks.values())) == EXIT_OK


def test_more_ranks_than_nodes_warn_that_ranks_share_a_node(tmp_path):
    binding = run_doctor(tmp_path, TWO_SOCKETS, tp=4)["binding"]
    assert binding.status == "warn"
    assert [r["numa_node"] for r in binding.value["ranks"]] == [0, 0, 1, 1]
    assert any("share NUMA node" in w for w in binding.value["warnings"])
    assert any(
        a.startswith("ranks share NUMA node(s) 0-1") and "--tp 2" in a for a in binding.advice
    )


def test_explicit_lists_on_sibling_threads_warn(tmp_path):
    # CPUs 8-11 are the SMT siblings of cores 0-3: two ranks on the same four cores.
    binding = run_doctor(tmp_path, SMALL_TWO_SOCKETS, tp=2, bind="0-3|8-11")["binding"]
    assert binding.status == "warn"
    assert rank_cpus(binding) == [(0, 1, 2, 3), (8, 9, 10, 11)]
    assert (
        "ranks 0-1 run threads on SMT siblings of the same physical cores (CPUs 0-3,8-11): they "
        "compete for those cores"
    ) in binding.value["warnings"]
    assert any("one CPU per physical core" in a and BIND_ENV in a for a in binding.advice)
    assert any("give each rank CPUs of a different node" in a for a in binding.advice)


def test_nobind_warns_and_splits_threads_between_ranks(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    binding = run_doctor(tmp_path, TWO_SOCKETS, tp=2, bind="nobind")["binding"]
    assert binding.status == "warn"
    assert [(r["numa_node"], r["cpus"]) for r in binding.value["ranks"]] == [(None, "")] * 2
    assert any(a.startswith("--bind auto pins") for a in binding.advice)
    # 32 physical cores for two unpinned ranks
    assert "OMP_NUM_THREADS=16 splits the cores" in binding.advice


@pytest.mark.parametrize(
    ("bind", "message"),
    [
        ("0-3|3-7", "CPU(s) 3 appear in the lists of rank 0 and rank 1"),
        ("0-3|", "rank 1's CPU list is empty"),
        ("0-3", "gives 1 CPU list(s) but --tp is 2"),
        ("0-3|200-203", "offline or absent"),
    ],
)
def test_bad_explicit_spec_fails_with_the_planners_message(tmp_path, bind, message):
    checks = run_doctor(tmp_path, SMALL_TWO_SOCKETS, tp=2, bind=bind)
    binding = checks["binding"]
    assert binding.status == "fail"
    assert message in binding.value["error"] and message in binding.advice[0]
    assert binding.summary == f"--bind {bind} with --tp 2 cannot be planned"
    # the memory plan needs a binding: skipped with a pointer, not a second failure
    assert checks["memory plan"].status == "warn"
    assert checks["memory plan"].summary.startswith("not planned (no binding: ")
    assert exit_code(list(checks.values())) == EXIT_FAIL


def test_bind_from_the_environment_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv(BIND_ENV, "0-3|3-7")
    binding = run_doctor(tmp_path, SMALL_TWO_SOCKETS, tp=2)["binding"]
    assert binding.status == "fail"
    assert binding.value["bind"] == f"{BIND_ENV}=0-3|3-7"
    assert binding.value["error"].startswith(f"{BIND_ENV}: CPU(s) 3 appear")


def test_cgroup_cpuset_narrower_than_the_node_limits_the_plan(tmp_path):
    # one node: cores 0-7, siblings 8-15; the cgroup grants four cores and their siblings
    machine = Machine(cores_per_node=8, smt=2)
    checks = run_doctor(
        tmp_path,
        machine,
        cgroup={
            "/": {"cpuset.cpus.effective": "0-15"},
            "/svc": {"cpuset.cpus.effective": "0-3,8-11"},
        },
    )
    assert checks["cgroup"].value["cpuset"] == {
        "version": 2,
        "path": "/svc",
        "cpus": "0-3,8-11",
        "mems": None,
    }
    assert checks["numa"].value["nodes"][0]["cpus"] == "0-3,8-11"
    assert rank_cpus(checks["binding"]) == [(0, 1, 2, 3)]
    assert checks["binding"].value["frontend"]["cpus"] == "8-11"


# --- memory --------------------------------------------------------------------------------

# 1 GiB available per node: free memory only, no page cache or reclaimable slab
TIGHT_NODES = Machine(sockets=2, cores_per_node=4, mem_free_gib=1, file_gib=0, sreclaimable_gib=0)


def test_memory_plan_that_does_not_fit_a_node_fails_with_what_fits(tmp_path):
    engine = dict(tp=2, kv_cache_space_gib=2.0, max_num_seqs=8192)
    checks = run_doctor(tmp_path / "a", TIGHT_NODES, **engine)
    memory = checks["memory plan"]
    assert memory.status == "fail" and memory.value["fits"] is False
    assert "lower --kv-cache-space to" in memory.advice[0]
    largest = memory.value["largest_kv_cache_gib"]
    assert 0 < largest < 1
    assert f"{largest:.2f} GiB per rank" in memory.advice[1]
    assert memory.value["largest_kv_tokens"] > 0
    assert exit_code(list(checks.values())) == EXIT_FAIL
    # the largest size it names plans on the same machine
    refit = run_doctor(tmp_path / "b", TIGHT_NODES, **(engine | {"kv_cache_space_gib": largest}))
    assert refit["memory plan"].status == "ok", refit["memory plan"]
    assert refit["memory plan"].value["fits"] is True
    assert refit["memory plan"].value["largest_kv_cache_gib"] == largest
    for rank in refit["memory plan"].value["ranks"]:
        assert rank["node_mem_available_bytes"] == GiB
        assert rank["total_bytes"] <= rank["budget_bytes"]


def test_cgroup_memory_max_below_the_plan_fails(tmp_path):
    limit = {"/svc": {"memory.max": str(GiB), "memory.current": "0"}}
    checks = run_doctor(tmp_path, Machine(cores_per_node=4), cgroup=limit)
    cgroup = checks["cgroup"]
    assert cgroup.status == "fail"
    assert cgroup.value["memory_limit_bytes"] == GiB
    assert cgroup.value["plan_needs_bytes"] > GiB
    assert "MemoryMax=" in cgroup.advice[0] and "--kv-cache-space" in cgroup.advice[0]
    assert checks["memory plan"].status == "fail"
    assert exit_code(list(checks.values())) == EXIT_FAIL


def test_cgroup_memory_max_above_the_plan_is_ok(tmp_path):
    limit = {"/svc": {"memory.max": str(8 * GiB), "memory.current": "0"}}
    checks = run_doctor(tmp_path, Machine(cores_per_node=4), cgroup=limit)
    assert checks["cgroup"].status == "ok"
    assert checks["cgroup"].value["plan_needs_bytes"] < 8 * GiB
    assert checks["memory plan"].status == "ok"


def test_cgroup_limit_mostly_used_by_others_warns(tmp_path):
    limit = {"/svc": {"memory.max": str(8 * GiB), "memory.current": str(8 * GiB - GiB // 2)}}
    cgroup = run_doctor(tmp_path, Machine(cores_per_node=4), cgroup=limit)["cgroup"]
    assert cgroup.status == "warn"
    assert cgroup.value["memory_room_bytes"] == GiB // 2
    assert cgroup.advice[0].startswith("only 0.50 GiB of the 8.00 GiB limit is free")


def test_node_outside_cpuset_mems_warns(tmp_path):
    machine = Machine(sockets=2, cores_per_node=4)
    sys_root, proc_root = write_machine(tmp_path, machine)
    (proc_root / "self" / "status").write_text("Name:\tpython\nMems_allowed_list:\t0\n")
    inputs = DoctorInputs(
        engine=EngineArgs(model=default_model_dir(), tp=2),
        sysfs_root=sys_root,
        proc_root=proc_root,
        syscalls=FakeSyscalls(frozenset(machine.cpus)),
    )
    checks = {c.name: c for c in collect(inputs)}
    assert checks["numa"].status == "warn"
    assert [n["mem_allowed"] for n in checks["numa"].value["nodes"]] == [True, False]
    assert "AllowedMemoryNodes=" in checks["numa"].advice[0]
    # auto keeps ranks off the node it may not allocate on
    assert {r["numa_node"] for r in checks["binding"].value["ranks"]} == {0}


# --- system calls --------------------------------------------------------------------------


def test_eperm_on_set_mempolicy_warns_and_names_the_fix(monkeypatch):
    def denied() -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(syscalls, "set_mempolicy_default", denied)
    check = syscalls.numa_syscalls_check(syscalls.LibcNumaSyscalls())
    assert check.status == "warn"
    assert check.value["calls"]["set_mempolicy"] == "EPERM"
    assert check.value["calls"]["sched_getaffinity"] == "permitted"
    assert "--cap-add SYS_NICE" in check.advice[0] and "SystemCallFilter=" in check.advice[0]


def test_denied_affinity_and_unexpected_errors_warn_without_crashing(tmp_path):
    deny = (("sched_setaffinity", errno.EPERM), ("get_mempolicy", errno.ENOSYS))
    checks = run_doctor(tmp_path, Machine(cores_per_node=4), deny=deny)
    check = checks["numa syscalls"]
    assert check.status == "warn"
    assert check.value["calls"] == {
        "sched_getaffinity": "permitted",
        "get_mempolicy": "ENOSYS",
        "set_mempolicy": "permitted",
        "sched_setaffinity": "EPERM",
    }
    assert any("--bind nobind" in a for a in check.advice)
    assert exit_code(list(checks.values())) == EXIT_OK

    class Broken(FakeSyscalls):
        def get_mempolicy(self) -> int:
            raise RuntimeError("libc is gone")

    broken = syscalls.numa_syscalls_check(Broken(frozenset({0})))
    assert broken.status == "warn"
    assert broken.value["calls"]["get_mempolicy"] == "error: RuntimeError: libc is gone"


def test_only_enosys_on_mempolicy_says_the_kernel_lacks_numa():
    check = syscalls.numa_syscalls_check(
        FakeSyscalls(
            frozenset({0}), (("get_mempolicy", errno.ENOSYS), ("set_mempolicy", errno.ENOSYS))
        )
    )
    assert check.status == "warn" and "no NUMA support" in check.advice[0]


# --- runtime and dtype ---------------------------------------------------------------------

TORCH_GOMP = "/venv/lib/python3.11/site-packages/torch/lib/libgomp.so.1"


def maps_line(path: str, start: int) -> str:
    return f"{start:012x}-{start + 4096:012x} r-xp 00000000 fe:00 1234   {path}"


def test_openmp_runtimes_are_counted_once_per_file():
    text = "\n".join(
        [
            maps_line(TORCH_GOMP, 0x1000),
            maps_line(TORCH_GOMP, 0x2000),
            maps_line("/usr/lib/libgomp-a34b3233.so.1.0.0 (deleted)", 0x3000),
            maps_line("/opt/intel/lib/libiomp5.so", 0x4000),
            maps_line("/usr/lib/libgompish.so", 0x5000),
            "7ff000000000-7ff000001000 rw-p 00000000 00:00 0",
        ]
    )
    assert openmp_runtimes(text) == [
        TORCH_GOMP,
        "/usr/lib/libgomp-a34b3233.so.1.0.0",
        "/opt/intel/lib/libiomp5.so",
    ]


def test_two_openmp_runtimes_fail_and_none_warns(tmp_path):
    maps = tmp_path / "self" / "maps"
    maps.parent.mkdir()
    maps.write_text(maps_line(TORCH_GOMP, 0x1000) + "\n" + maps_line("/lib/libiomp5.so", 0x9000))
    two = openmp_check(tmp_path)
    assert two.status == "fail" and two.value["runtimes"] == [TORCH_GOMP, "/lib/libiomp5.so"]
    assert "LD_PRELOAD" in two.advice[0]
    maps.write_text(maps_line("/usr/lib/libc.so.6", 0x1000))
    assert openmp_check(tmp_path).status == "warn"


def test_this_process_maps_exactly_one_openmp_runtime():
    check = openmp_check(Path("/proc"))
    assert check.status == "ok", check
    assert len(check.value["runtimes"]) == 1


@pytest.mark.parametrize(
    ("flags", "requested", "status", "chosen"),
    [
        ("avx2 avx512f avx512_bf16", "auto", "ok", "bfloat16"),
        ("avx2 avx512f", "auto", "ok", "bfloat16"),
        ("avx2", "auto", "ok", "bfloat16"),
        ("avx2", "float32", "warn", "float32"),
        ("avx2", "bfloat16", "ok", "bfloat16"),
        ("sse4_2", "auto", "ok", "float32"),
        ("avx2", "float16", "fail", None),
    ],
)
def test_dtype_verdicts(tmp_path, flags, requested, status, chosen):
    (tmp_path / "cpuinfo").write_text(
        f"processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: {flags}\n"
    )
    check = dtype_check(DoctorInputs(engine=EngineArgs(dtype=requested), proc_root=tmp_path))
    assert check.status == status
    assert check.value.get("chosen") == chosen
    if status == "warn":
        assert "--dtype bfloat16" in check.advice[0]
    if status == "fail":
        assert "--dtype float32" in check.advice[0]


@pytest.mark.parametrize(
    "flags, detected, status",
    [
        ("avx512f avx512_bf16 amx_bf16 amx_tile", "avx512bf16", "warn"),  # AMX refused by the OS
        ("avx512f avx512_bf16 amx_bf16 amx_tile", "amx", "ok"),
        ("avx512f avx512_bf16", "avx512bf16", "ok"),  # no AMX to miss (Zen 4)
    ],
)
def test_native_check_warns_when_the_cpu_has_amx_but_cpud_cannot_use_it(
    tmp_path, monkeypatch, flags, detected, status
):
    from cpud import native

    (tmp_path / "cpuinfo").write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    info = {"available": True, "isa": detected, "detected_isa": detected}
    monkeypatch.setattr(native, "info", lambda: info)
    check = native_check(DoctorInputs(engine=EngineArgs(), proc_root=tmp_path))
    assert check.status == status
    assert check.summary == f"ISA tier {detected} (best this CPU runs: {detected})"
    if status == "warn":
        assert "ARCH_REQ_XCOMP_PERM" in check.advice[0] and "Linux >= 5.16" in check.advice[0]


# --- reports and the command line ----------------------------------------------------------


def test_text_and_json_reports():
    checks = [
        Check("a", "ok", "fine", {"x": 1}),
        Check("b", "warn", "meh", None, ("--flag 1",), ("detail",)),
        Check("c", "fail", "broken", None, ("--other 2", "or ENV=3")),
    ]
    assert render(checks).splitlines() == [
        "[ok]   a: fine",
        "[warn] b: meh",
        "         detail",
        "       -> --flag 1",
        "[FAIL] c: broken",
        "       -> --other 2",
        "       -> or ENV=3",
        "3 checks: 1 failed, 1 with warnings (exit 1)",
    ]
    data = report(checks)
    assert data["ok"] is False
    assert data["checks"][2] == {
        "name": "c",
        "status": "fail",
        "summary": "broken",
        "value": None,
        "advice": "--other 2; or ENV=3",
    }
    assert report(checks[:2])["ok"] is True and exit_code(checks[:2]) == EXIT_OK


def test_bad_arguments_exit_2(tmp_path, capsys):
    assert main(["doctor", "--model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["doctor", "--dtype", "fp8"]) == 2
    with pytest.raises(SystemExit) as exc:
        main(["doctor", "--tp", "0"])
    assert exc.value.code == 2


def doctor_cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (BIND_ENV, RESERVED_ENV)}
    return subprocess.run(
        [sys.executable, "-m", "cpud.cli", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_this_machine_json_has_every_item_and_exits_0():
    result = doctor_cli("--json")
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(result.stdout)
    assert data["ok"] is True
    checks = {c["name"]: c for c in data["checks"]}
    assert tuple(checks) == ITEMS
    assert all(c["status"] in ("ok", "warn") for c in checks.values())
    assert len(checks["openmp"]["value"]["runtimes"]) == 1
    affinity = os.sched_getaffinity(0)
    binding = checks["binding"]["value"]
    assert {cpu for r in binding["ranks"] for cpu in parse_cpulist(r["cpus"])} <= affinity
    assert set(parse_cpulist(checks["numa"]["value"]["allowed_cpus"])) == affinity


def test_this_machine_text_report():
    result = doctor_cli()
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    items = [line for line in lines if line.startswith("[")]
    assert [line.split("]", 1)[1].strip().split(":")[0] for line in items] == list(ITEMS)
    assert lines[-1].endswith("(exit 0)")


def test_fabricated_tree_through_the_cli_bad_spec_exits_1(tmp_path):
    sys_root, proc_root = write_machine(tmp_path, SMALL_TWO_SOCKETS)
    result = doctor_cli(
        "--json",
        "--sysfs-root",
        str(sys_root),
        "--proc-root",
        str(proc_root),
        "--tp",
        "2",
        "--bind",
        "0-3|",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["binding"]["status"] == "fail"
    assert "rank 1's CPU list is empty" in checks["binding"]["advice"]
    assert checks["numa"]["value"]["nodes"][1]["id"] == 1


def test_model_check_lists_a_gguf_files_tensor_types(model_factory, tmp_path):
    from gguf import GGMLQuantizationType as T
    from gguf_writer import write_gguf

    from cpud.doctor.model_check import model_check
    from cpud.doctor.planning import plan

    path = write_gguf(model_factory("qwen3"), tmp_path / "m.gguf", T.Q8_0)
    check = model_check(plan(DoctorInputs(engine=EngineArgs(model=path, num_kv_blocks=64))))
    assert check.status == "ok", check
    assert check.value["format"] == "gguf" and check.value["gguf_architecture"] == "qwen3"
    types = check.value["tensor_types"]
    assert set(types) == {"Q8_0", "F32"}
    assert sum(t["bytes"] for t in types.values()) <= check.value["file_bytes"]
    assert any(line.startswith("Q8_0: ") for line in check.details)


def test_model_check_names_the_family_and_its_recipe(model_factory):
    from cpud.doctor.model_check import model_check
    from cpud.doctor.planning import plan

    path = model_factory("gemma3_text")
    check = model_check(plan(DoctorInputs(engine=EngineArgs(model=path, num_kv_blocks=64))))
    assert check.status == "ok", check
    assert check.value["family"] == "gemma3"
    recipe = check.value["recipe"]
    assert "rms_fp32_weight" in recipe and "sandwich norms" in recipe and "gelu_tanh" in recipe
    assert "sliding window" in recipe
    assert check.details[0] == f"family gemma3: {recipe}"


def test_model_check_fails_with_the_reason_for_a_broken_model(tmp_path):
    from cpud.doctor.model_check import model_check
    from cpud.doctor.planning import plan

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(10))
    check = model_check(plan(DoctorInputs(engine=EngineArgs(model=bad))))
    assert check.status == "fail" and "bad.gguf" in check.summary


@pytest.mark.parametrize(
    "content, status, mode",
    [
        ("always [madvise] never\n", "ok", "madvise"),
        ("[always] madvise never\n", "ok", "always"),
        ("always madvise [never]\n", "warn", "never"),
        (None, "warn", None),
    ],
)
def test_huge_pages_mode_is_read_and_never_warns_with_the_fix(tmp_path, content, status, mode):
    if content is not None:
        thp = tmp_path / "kernel/mm/transparent_hugepage"
        thp.mkdir(parents=True)
        (thp / "enabled").write_text(content)
    check = huge_pages_check(DoctorInputs(sysfs_root=tmp_path))
    assert (check.status, check.value["mode"]) == (status, mode)
    if status == "warn":
        assert any("transparent_hugepage/enabled" in a for a in check.advice)
    else:
        assert check.advice == ()
